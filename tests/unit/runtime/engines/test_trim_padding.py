"""Trimmed passes (training.trim_padding) compute on each micro-batch's longest sequence only and
give the same logprobs, entropies, values and gradients as passes over the dock's full columns."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import tiny_qwen2  # tests/tiny_models.py

from rldock.runtime.engines.policy import plan_micro_batches, response_logprobs, response_logprobs_and_entropy
from rldock.runtime.engines.values import response_values
from rldock.runtime.models.value import ValueModel

PL, SL = 6, 7


def _tiny_model():
    torch.manual_seed(0)
    return tiny_qwen2(vocab_size=40, num_hidden_layers=2, max_position_embeddings=64)


def _batch():
    """Six rows: left-padded prompts of 1..6 tokens and right-padded responses of 0..5 tokens
    (never the full SL), in mixed order."""
    prompt_lengths = [3, 1, 6, 2, 4, 2]
    response_lengths = [2, 5, 1, 0, 3, 4]
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.zeros(6, PL, dtype=torch.int64)
    response_ids = torch.zeros(6, SL, dtype=torch.int64)
    for i, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        prompt_ids[i, PL - p :] = torch.randint(3, 40, (p,), generator=generator)
        response_ids[i, :r] = torch.randint(3, 40, (r,), generator=generator)
    return prompt_ids, (prompt_ids != 0).long(), response_ids, (response_ids != 0).long()


def test_plans_keep_only_each_passes_own_columns_and_cover_every_row_once():
    prompt_ids, prompt_mask, response_ids, response_mask = _batch()
    plans = plan_micro_batches(prompt_mask, response_mask, micro_batch_size=2, trim=True)
    assert sorted(torch.cat([p.rows for p in plans]).tolist()) == list(range(6))
    for plan in plans:
        longest_prompt = int(prompt_mask[plan.rows].sum(1).max())
        longest_response = int(response_mask[plan.rows].sum(1).max())
        assert plan.prompt_start == PL - longest_prompt
        assert plan.response_end == max(longest_response, 1)
    # sorted by tokens: the two shortest rows (3: 2 tokens, 0: 5 tokens) form the first pass
    assert [p.rows.tolist() for p in plans][0] == [3, 0]
    untrimmed = plan_micro_batches(prompt_mask, response_mask, micro_batch_size=4, trim=False)
    assert [(p.rows.tolist(), p.prompt_start, p.response_end) for p in untrimmed] == [
        ([0, 1, 2, 3], 0, SL),
        ([4, 5], 0, SL),
    ]


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4, 6])
def test_trimmed_logprobs_entropy_and_gradients_equal_untrimmed(micro_batch_size):
    batch = _batch()
    full_model, trimmed_model = _tiny_model(), _tiny_model()
    full = response_logprobs_and_entropy(full_model, *batch, micro_batch_size=micro_batch_size)
    trimmed = response_logprobs_and_entropy(trimmed_model, *batch, micro_batch_size=micro_batch_size, trim=True)
    torch.testing.assert_close(trimmed.logprobs, full.logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(trimmed.entropy, full.entropy, rtol=0, atol=1e-5)
    mask = batch[3]
    assert torch.all(trimmed.logprobs[mask == 0] == 0)  # trimmed columns come back as zeros
    full.logprobs.sum().backward()
    trimmed.logprobs.sum().backward()
    for (name, p_full), p_trim in zip(full_model.named_parameters(), trimmed_model.parameters()):
        torch.testing.assert_close(p_trim.grad, p_full.grad, rtol=0, atol=1e-6, msg=name)
    with torch.no_grad():
        inference = response_logprobs(full_model, *batch, micro_batch_size=micro_batch_size, trim=True)
    torch.testing.assert_close(inference, full.logprobs.detach(), rtol=0, atol=1e-6)


def test_trimmed_values_and_gradients_equal_untrimmed():
    batch = _batch()
    lm = _tiny_model()
    model = ValueModel(lm.base_model, lm.config.hidden_size)
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the zero head would make every value 0
    twin = copy.deepcopy(model)
    full = response_values(model, *batch, micro_batch_size=4)
    trimmed = response_values(twin, *batch, micro_batch_size=4, trim=True)
    torch.testing.assert_close(trimmed, full, rtol=0, atol=1e-6)
    (full**2).sum().backward()
    (trimmed**2).sum().backward()
    for (name, p_full), p_trim in zip(model.named_parameters(), twin.parameters()):
        # float32 rounding relative to the largest entry (these gradients reach ~100)
        assert float((p_trim.grad - p_full.grad).abs().max()) <= 1e-6 * float(p_full.grad.abs().max()), name
