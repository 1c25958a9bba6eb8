"""Micro-batches under a token budget: rows sorted by length, each pass within the budget (a longer
row alone), and the passes' results equal to row-count passes."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen2  # tests/tiny_models.py

from rldock.runtime.engines.policy import micro_batch_rows, response_logprobs

# prompt tokens (left-padded, PL 6) and response tokens (right-padded, SL 5) of 6 rows
PROMPTS = [2, 6, 1, 3, 6, 2]
RESPONSES = [1, 5, 1, 2, 4, 5]


def _masks():
    prompt_mask = torch.tensor([[0] * (6 - n) + [1] * n for n in PROMPTS])
    response_mask = torch.tensor([[1] * n + [0] * (5 - n) for n in RESPONSES])
    return prompt_mask, response_mask


def _computed(rows):
    return len(rows) * (max(PROMPTS[r] for r in rows) + max(RESPONSES[r] for r in rows))


def test_row_counts_without_a_budget():
    prompt_mask, response_mask = _masks()
    plain = micro_batch_rows(prompt_mask, response_mask, micro_batch_size=4, trim=False)
    assert [rows.tolist() for rows in plain] == [[0, 1, 2, 3], [4, 5]]
    # sorted by token count (3, 11, 2, 5, 10, 7), shortest first
    trimmed = micro_batch_rows(prompt_mask, response_mask, micro_batch_size=4, trim=True)
    assert [rows.tolist() for rows in trimmed] == [[2, 0, 3, 5], [4, 1]]


@pytest.mark.parametrize("budget", [1, 6, 12, 20, 100])
def test_every_pass_keeps_to_the_budget_and_every_row_runs_once(budget):
    prompt_mask, response_mask = _masks()
    runs = [
        rows.tolist()
        for rows in micro_batch_rows(prompt_mask, response_mask, micro_batch_size=4, trim=True, max_tokens=budget)
    ]
    assert sorted(r for rows in runs for r in rows) == list(range(6))
    for rows in runs:
        assert len(rows) <= 4
        assert len(rows) == 1 or _computed(rows) <= budget  # a row over the budget runs alone


def test_short_rows_share_a_pass_and_long_ones_do_not():
    prompt_mask, response_mask = _masks()
    runs = [
        rows.tolist()
        for rows in micro_batch_rows(prompt_mask, response_mask, micro_batch_size=6, trim=True, max_tokens=12)
    ]
    # rows 2 and 0 (2 and 3 tokens: 2 x (2 + 1) = 6), then 3 alone (3 x (3 + 2) = 15 > 12), 5 alone
    # (2 x (3 + 5) = 16 > 12), and the long ones alone
    assert runs == [[2, 0], [3], [5], [4], [1]]
    assert sum(_computed(rows) for rows in runs) < 6 * 11  # against one padded pass over all rows


def test_a_bad_budget_names_itself():
    prompt_mask, response_mask = _masks()
    with pytest.raises(ValueError, match="max_tokens"):
        micro_batch_rows(prompt_mask, response_mask, micro_batch_size=2, trim=True, max_tokens=0)


def test_budget_passes_give_the_same_logprobs():
    torch.manual_seed(0)
    model = tiny_qwen2(vocab_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2).eval()
    prompt_mask, response_mask = _masks()
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(1, 40, prompt_mask.shape, generator=generator) * prompt_mask
    response_ids = torch.randint(1, 40, response_mask.shape, generator=generator) * response_mask
    with torch.no_grad():
        rows = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch_size=6)
        budget = response_logprobs(
            model, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch_size=6, trim=True, max_tokens=12
        )
    torch.testing.assert_close(budget, rows, rtol=1e-5, atol=1e-5)
