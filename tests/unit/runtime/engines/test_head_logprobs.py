"""The chunked LM head: the same logprobs, entropy and gradients as full float32 logits, with no
(n, V) tensor kept for the backward, and the policy passes on top of it equal to full logits."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen2  # tests/tiny_models.py

from rldock.runtime.engines.head_logprobs import chunk_positions, head_logprobs
from rldock.runtime.engines.policy import response_logprobs, response_logprobs_and_entropy


def _full_logits_scores(hidden, weight, bias, targets, temperature):
    """The definition: every logit at once, log-softmax, the target picked."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # (n, V)
    log_p = logits.log_softmax(dim=-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(dim=-1)


def _head_case(dtype, *, num_tokens=7, hidden_size=5, vocab_size=11, with_bias=True):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab_size, hidden_size, generator=generator, dtype=dtype, requires_grad=True)
    bias = torch.randn(vocab_size, generator=generator, dtype=dtype, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab_size, (num_tokens,), generator=generator)
    return hidden, weight, bias, targets


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_equal_the_full_logits(chunk, temperature):
    hidden, weight, bias, targets = _head_case(torch.float32)
    logprobs, entropy = head_logprobs(
        hidden, weight, bias, targets, temperature=temperature, with_entropy=True, chunk=chunk
    )
    want_logprobs, want_entropy = _full_logits_scores(hidden, weight, bias, targets, temperature)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad  # a metric


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_gradients_pass_gradcheck(with_bias, temperature):
    hidden, weight, bias, targets = _head_case(torch.float64, with_bias=with_bias)

    def logprobs(hidden, weight, *bias):
        return head_logprobs(hidden, weight, bias[0] if bias else None, targets, temperature=temperature, chunk=3)[0]

    assert torch.autograd.gradcheck(logprobs, (hidden, weight, *([bias] if with_bias else [])))


def test_gradients_equal_the_full_logits_and_skip_a_frozen_weight():
    hidden, weight, bias, targets = _head_case(torch.float32)
    upstream = torch.randn(len(targets), generator=torch.Generator().manual_seed(1))
    (head_logprobs(hidden, weight, bias, targets, chunk=2)[0] * upstream).sum().backward()
    got = [hidden.grad, weight.grad, bias.grad]
    for tensor in (hidden, weight, bias):
        tensor.grad = None
    (_full_logits_scores(hidden, weight, bias, targets, 1.0)[0] * upstream).sum().backward()
    for mine, want in zip(got, [hidden.grad, weight.grad, bias.grad]):
        torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-6)
    frozen = weight.detach()  # training.freeze_embeddings with tied embeddings: no weight gradient
    hidden.grad = None
    head_logprobs(hidden, frozen, None, targets, chunk=2)[0].sum().backward()
    assert hidden.grad is not None and frozen.grad is None


def test_the_backward_keeps_no_vocabulary_sized_tensor():
    num_tokens, hidden_size, vocab_size = 64, 8, 4096
    hidden, weight, _, targets = _head_case(
        torch.float32, num_tokens=num_tokens, hidden_size=hidden_size, vocab_size=vocab_size, with_bias=False
    )
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        head_logprobs(hidden, weight, None, targets, chunk=16)
    # the inputs and one float per token: nothing of shape (n, V)
    assert all(t.numel() <= vocab_size * hidden_size for t in saved)
    assert not any(t.shape == (num_tokens, vocab_size) for t in saved)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _full_logits_scores(hidden, weight, None, targets, 1.0)
    assert any(t.numel() >= num_tokens * vocab_size for t in saved)  # the check can see one


def test_chunk_positions_bound_the_chunk_bytes():
    assert chunk_positions(49_152, chunk_bytes=32 << 20) == 170
    assert chunk_positions(10**9, chunk_bytes=1) == 1


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_qwen2(
        vocab_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )


def _batch():
    generator = torch.Generator().manual_seed(2)
    prompt_ids = torch.randint(1, 48, (4, 6), generator=generator)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6, [0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]])
    response_ids = torch.randint(1, 48, (4, 5), generator=generator)
    response_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    return prompt_ids, prompt_mask * 1, response_ids, response_mask


def _full_logits_policy(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature):
    """Every position's float32 logits, then the response slice: the passes' previous definition."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    prompt_len, response_len = prompt_ids.shape[1], response_ids.shape[1]
    log_p = (logits[:, prompt_len - 1 : prompt_len + response_len - 1] / temperature).log_softmax(-1)
    picked = log_p.gather(-1, response_ids[..., None]).squeeze(-1)
    return torch.where(response_mask.bool(), picked, 0.0), -(log_p.exp() * log_p).sum(-1) * response_mask


@pytest.mark.parametrize("trim", [False, True])
def test_policy_scores_and_their_gradients_equal_full_logits(model, trim):
    batch = _batch()
    scores = response_logprobs_and_entropy(model, *batch, micro_batch_size=3, temperature=0.8, trim=trim)
    upstream = torch.randn(scores.logprobs.shape, generator=torch.Generator().manual_seed(3))
    model.zero_grad()
    (scores.logprobs * upstream).sum().backward()
    mine = {name: p.grad.clone() for name, p in model.named_parameters()}
    want_logprobs, want_entropy = _full_logits_policy(model, *batch, temperature=0.8)
    model.zero_grad()
    (want_logprobs * upstream).sum().backward()
    torch.testing.assert_close(scores.logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores.entropy, want_entropy.detach(), rtol=1e-5, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(mine[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_inference_logprobs_equal_the_scores(model):
    batch = _batch()
    with torch.no_grad():
        plain = response_logprobs(model, *batch, micro_batch_size=2, trim=True)
        scores = response_logprobs_and_entropy(model, *batch, micro_batch_size=4)
    torch.testing.assert_close(plain, scores.logprobs, rtol=1e-5, atol=1e-6)
