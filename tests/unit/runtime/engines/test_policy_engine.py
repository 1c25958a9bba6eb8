"""Policy inputs and response logprobs: the layout of docs/architecture.md and a per-row reference."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen2  # tests/tiny_models.py

from rldock.runtime.engines.head_logprobs import head_logprobs
from rldock.runtime.engines.policy import (
    build_policy_inputs,
    response_logprobs,
    response_logprobs_and_entropy,
)

PAD = 0


def _batch():
    prompt_ids = torch.tensor([[PAD, PAD, 5, 6], [7, 8, 9, 10], [PAD, PAD, PAD, 11]])  # (3, PL=4)
    prompt_mask = (prompt_ids != PAD).long()
    response_ids = torch.tensor([[12, 13, PAD], [14, PAD, PAD], [15, 16, 17]])  # (3, SL=3)
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    return prompt_ids, prompt_mask, response_ids, response_mask


def test_build_policy_inputs_on_a_hand_example():
    inputs = build_policy_inputs(*_batch())
    assert inputs.input_ids.tolist() == [
        [PAD, PAD, 5, 6, 12, 13, PAD],
        [7, 8, 9, 10, 14, PAD, PAD],
        [PAD, PAD, PAD, 11, 15, 16, 17],
    ]
    assert inputs.attention_mask.tolist() == [
        [0, 0, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 1, 1],
    ]
    # cumsum(mask) - 1, clamped at 0: real tokens count from 0 whatever the left padding.
    assert inputs.position_ids.tolist() == [
        [0, 0, 0, 1, 2, 3, 3],
        [0, 1, 2, 3, 4, 4, 4],
        [0, 0, 0, 0, 1, 2, 3],
    ]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_qwen2(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,  # peaked distributions, so a wrong position shows up clearly
    ).eval()


def _reference_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask):
    """One unpadded sequence per row, scored token by token: the definition, no batching tricks."""
    out = torch.zeros(response_ids.shape)
    for row in range(prompt_ids.shape[0]):
        prompt = prompt_ids[row][prompt_mask[row].bool()]
        response = response_ids[row][response_mask[row].bool()]
        sequence = torch.cat([prompt, response]).unsqueeze(0)  # (1, T)
        with torch.no_grad():
            logits = model(input_ids=sequence).logits[0]  # (T, V)
        for t, token in enumerate(response.tolist()):
            out[row, t] = logits[len(prompt) + t - 1].log_softmax(-1)[token]
    return out


@pytest.mark.parametrize("micro_batch_size", [1, 2, 3])
def test_response_logprobs_match_an_unpadded_per_token_loop(model, micro_batch_size):
    batch = _batch()
    expected = _reference_logprobs(model, *batch)
    with torch.no_grad():
        got = response_logprobs(model, *batch, micro_batch_size=micro_batch_size)
    assert got.shape == (3, 3) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got[batch[3] == 0] == 0).all()


def test_temperature_divides_the_logits(model):
    batch = _batch()
    with torch.no_grad():
        got = response_logprobs(model, *batch, micro_batch_size=3, temperature=2.0)
        inputs = build_policy_inputs(*batch)
        logits = model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
        ).logits[:, 3:6]  # positions PL-1 .. PL+SL-2
    expected = (logits / 2.0).log_softmax(-1).gather(-1, batch[2].unsqueeze(-1)).squeeze(-1) * batch[3]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_entropy_and_gradients(model):
    batch = _batch()
    scores = response_logprobs_and_entropy(model, *batch, micro_batch_size=2)
    with torch.no_grad():
        plain = response_logprobs(model, *batch, micro_batch_size=2)
    torch.testing.assert_close(scores.logprobs.detach(), plain)
    assert scores.entropy.shape == (3, 3)
    assert (scores.entropy[batch[3] == 0] == 0).all()
    live = scores.entropy[batch[3] == 1]
    assert ((live > 0) & (live <= torch.log(torch.tensor(32.0)) + 1e-5)).all()

    model.zero_grad()
    scores.logprobs.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad()


def test_micro_batch_size_must_be_positive(model):
    with pytest.raises(ValueError, match="micro_batch_size"):
        response_logprobs(model, *_batch(), micro_batch_size=0)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """The head's entropy of logits (n, V): an identity head (V = H) over them as hidden states."""
    targets = torch.zeros(logits.shape[0], dtype=torch.int64)
    return head_logprobs(logits, torch.eye(logits.shape[1]), None, targets, with_entropy=True, chunk=2)[1]


def test_entropy_of_known_distributions():
    uniform = torch.zeros(6, 7)  # (n, V): equal logits
    torch.testing.assert_close(_entropy(uniform), torch.full((6,), float(torch.log(torch.tensor(7.0)))))
    peaked = torch.tensor([[100.0, 0.0, 0.0, 0.0]])  # (1, V=4): all mass on one token
    assert float(_entropy(peaked)) < 1e-30 + 1e-6
    two = torch.log(torch.tensor([[0.25, 0.75]]))  # H = -(.25 ln .25 + .75 ln .75)
    torch.testing.assert_close(_entropy(two), torch.tensor([0.5623351446]))
    logits = torch.randn(20, 11, generator=torch.Generator().manual_seed(0))
    expected = torch.distributions.Categorical(logits=logits).entropy()  # (20,)
    torch.testing.assert_close(_entropy(logits), expected)


def test_entropy_is_a_metric_only_and_matches_the_logits(model):
    batch = _batch()
    scores = response_logprobs_and_entropy(model, *batch, micro_batch_size=3)
    assert not scores.entropy.requires_grad  # no second (b, SL, V) graph: the loss has no entropy term
    with torch.no_grad():
        inputs = build_policy_inputs(*batch)
        logits = model(
            input_ids=inputs.input_ids, attention_mask=inputs.attention_mask, position_ids=inputs.position_ids
        ).logits[:, 3:6]  # (3, SL, V)
    expected = torch.distributions.Categorical(logits=logits).entropy()  # (3, SL)
    torch.testing.assert_close(scores.entropy, expected * batch[3], atol=1e-5, rtol=0)


def _trajectory_batch():
    """Row 0 a multi-turn trajectory: model tokens 12 13, tool tokens 20 21, model token 14; row 1
    single-turn. `response_mask` marks the model's tokens, the attention mask every real one."""
    prompt_ids = torch.tensor([[PAD, 5, 6], [7, 8, 9]])  # (2, PL=3)
    prompt_mask = (prompt_ids != PAD).long()
    response_ids = torch.tensor([[12, 13, 20, 21, 14, PAD], [15, 16, PAD, PAD, PAD, PAD]])  # (2, SL=6)
    response_mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]])
    return prompt_ids, prompt_mask, response_ids, response_mask, attention


@pytest.mark.parametrize("trim", [False, True])
@pytest.mark.parametrize("micro_batch_size", [1, 2])
def test_a_trajectory_is_attended_whole_and_scored_on_the_model_tokens_only(model, trim, micro_batch_size):
    prompt_ids, prompt_mask, response_ids, response_mask, attention = _trajectory_batch()
    # The definition: every attended token in context, each response token scored in place.
    expected = _reference_logprobs(model, prompt_ids, prompt_mask, response_ids, attention) * response_mask
    scores = response_logprobs_and_entropy(
        model,
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        micro_batch_size=micro_batch_size,
        trim=trim,
        attention_mask=attention,
    )
    torch.testing.assert_close(scores.logprobs.detach(), expected, atol=1e-5, rtol=0)
    assert (scores.logprobs[response_mask == 0] == 0).all() and (scores.entropy[response_mask == 0] == 0).all()
    # Token 14 is scored after the tool's tokens: masking them out of attention would change it.
    without_tools = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch_size=2)
    assert not torch.allclose(without_tools[0, 4], expected[0, 4])
    # Nothing a loss takes from a tool token's position reaches the weights.
    model.zero_grad()
    scores.logprobs[response_mask == 0].sum().backward(retain_graph=True)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
    scores.logprobs[0, 4].backward()  # while the model's token after the tools does
    assert any(p.grad is not None and p.grad.any() for p in model.parameters())
    model.zero_grad()
