"""The critic's value model: the policy body with a zero-initialised scalar head, scoring each
response token at the position whose logits score it in the policy."""

import copy

import pytest
import torch

from rldock.config.data import GeneratorSpec
from rldock.runtime.data import Row, tokenizer_corpus
from rldock.runtime.data.addition import generate_addition
from rldock.runtime.engines.policy import build_policy_inputs
from rldock.runtime.engines.values import response_values
from rldock.runtime.models.tiny import build_tiny_model
from rldock.runtime.models.value import load_value_model


@pytest.fixture(scope="module")
def value_model(tmp_path_factory):
    texts = tokenizer_corpus(
        [
            Row(r["prompt"], r["answer"], r["data_source"])
            for r in generate_addition(GeneratorSpec(name="addition", max_operand=9, num_prompts=20), seed=0).train
        ]
    )
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"), texts=texts, seed=0)
    return load_value_model(model_dir, dtype="float32", device="cpu")


def _batch():
    torch.manual_seed(0)
    prompt_ids = torch.randint(3, 15, (3, 4))  # (B, PL)
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    response_ids = torch.randint(3, 15, (3, 5))  # (B, SL)
    response_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    return prompt_ids, prompt_mask, response_ids, response_mask


def test_the_new_head_predicts_zero(value_model):
    values = response_values(value_model, *_batch(), micro_batch_size=2)
    assert values.shape == (3, 5) and torch.equal(values, torch.zeros(3, 5))


def test_values_come_from_the_position_before_each_token(value_model):
    value_model = copy.deepcopy(value_model)  # the module-scoped one keeps its zero head
    torch.nn.init.normal_(value_model.head.weight)
    prompt_ids, prompt_mask, response_ids, response_mask = _batch()
    with torch.no_grad():
        values = response_values(
            value_model, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch_size=2
        )  # (3, 5)
        inputs = build_policy_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
        every_position = value_model(inputs.input_ids, inputs.attention_mask, inputs.position_ids)  # (3, 9)
    # response token t of row b is chosen in the state ending at input position PL + t - 1 = 3 + t
    for b, t in [(0, 0), (0, 2), (1, 4), (2, 0)]:
        assert values[b, t].item() == pytest.approx(every_position[b, 3 + t].item(), abs=1e-5)
    assert torch.all(values[response_mask == 0] == 0)
    assert torch.any(values[response_mask == 1] != 0)


def test_gradient_checkpointing_leaves_the_critics_gradients_unchanged(value_model):
    # training.gradient_checkpointing applies to the critic: each decoder layer of the value model's
    # body is recomputed in backward, and the gradients are what plain backward gives.
    from rldock.runtime.models.layers import enable_activation_checkpointing

    def grads(model):
        torch.nn.init.normal_(model.head.weight)  # a zero head would zero every body gradient
        model.zero_grad()
        response_values(model, *_batch(), micro_batch_size=3).sum().backward()
        return {name: p.grad for name, p in model.named_parameters()}

    torch.manual_seed(1)
    plain = grads(copy.deepcopy(value_model))
    checkpointed_model = copy.deepcopy(value_model)
    assert enable_activation_checkpointing(checkpointed_model) == checkpointed_model.body.config.num_hidden_layers
    calls = []  # the first layer's attention runs again in backward: the recompute
    checkpointed_model.body.layers[0].self_attn.register_forward_hook(lambda *_: calls.append(1))
    torch.manual_seed(1)
    checkpointed = grads(checkpointed_model)
    assert len(calls) == 2
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, msg=name)


def test_a_trajectorys_values_attend_to_its_tool_tokens_and_are_zero_on_them(value_model):
    """A multi-turn trajectory: the model's tokens are valued (response_mask), every token is attended
    (attention_mask), so a model token after a tool's tokens is valued with them in view, as an unpadded
    forward pass of the whole sequence values it; trimmed and untrimmed passes agree."""
    value_model = copy.deepcopy(value_model)
    torch.nn.init.normal_(value_model.head.weight)
    prompt_ids, prompt_mask, response_ids, _ = _batch()
    attention = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])  # (B, SL)
    model_tokens = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 0, 0, 1], [1, 0, 1, 0, 0]])  # tools between
    with torch.no_grad():
        values = {
            trim: response_values(
                value_model,
                prompt_ids,
                prompt_mask,
                response_ids,
                model_tokens,
                micro_batch_size=2,
                trim=trim,
                attention_mask=attention,
            )
            for trim in (False, True)
        }
        for b in range(3):
            ids = torch.cat([prompt_ids[b][prompt_mask[b].bool()], response_ids[b][attention[b].bool()]])[None]
            whole = value_model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])[0]  # (L,)
            prompt_length = int(prompt_mask[b].sum())
            for t in model_tokens[b].nonzero().squeeze(1).tolist():
                for trim in (False, True):
                    assert values[trim][b, t].item() == pytest.approx(whole[prompt_length + t - 1].item(), abs=1e-5)
    for trim in (False, True):
        assert torch.all(values[trim][model_tokens == 0] == 0)
