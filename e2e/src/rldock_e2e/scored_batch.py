"""A small batch of prompts and responses laid out as the dock holds them, and the layouts a policy
pass runs it in: what the context-parallel rank tests score on every rank and in one process
(tests/ranks/test_context_parallel_ranks.py, test_context_expert_parallel_ranks.py). Never shipped."""

from __future__ import annotations

import torch

# The layouts a pass runs in: packed (each prompt once, 4D mask; `trim` and the packing cost rule
# pick it for this batch), padded rows (no trim, two passes of 2 rows, a 4D mask of their pads) and
# trimmed single rows (no pad left: no mask, causal over the whole sequence).
LAYOUTS = {
    "packed": dict(trim=True, micro_batch_size=4),
    "padded": dict(trim=False, micro_batch_size=2),
    "trimmed": dict(trim=True, micro_batch_size=1),
}
PROMPT_LENGTH, RESPONSE_LENGTH = 6, 7


def scored_batch(seed: int, *, vocab_size: int) -> dict[str, torch.Tensor]:
    """Two prompts (4 and 6 tokens, left-padded to 6) with two responses each (right-padded to 7):
    a packed pass of 27 tokens and padded rows of 13, neither a multiple of 2 or 4; and float64
    per-token weights (4, 7) for a loss linear in the logprobs."""
    g = torch.Generator().manual_seed(seed)
    prompt_lengths, response_lengths = [4, 4, 6, 6], [5, 3, 7, 2]
    prompt_ids = torch.zeros(4, PROMPT_LENGTH, dtype=torch.int64)
    prompt_mask = torch.zeros(4, PROMPT_LENGTH, dtype=torch.int64)
    response_ids = torch.zeros(4, RESPONSE_LENGTH, dtype=torch.int64)
    response_mask = torch.zeros(4, RESPONSE_LENGTH, dtype=torch.int64)
    prompts = [torch.randint(4, vocab_size, (n,), generator=g) for n in (4, 6)]
    for row, (p, r) in enumerate(zip(prompt_lengths, response_lengths)):
        prompt_ids[row, PROMPT_LENGTH - p :] = prompts[row // 2]
        prompt_mask[row, PROMPT_LENGTH - p :] = 1
        response_ids[row, :r] = torch.randint(4, vocab_size, (r,), generator=g)
        response_mask[row, :r] = 1
    weights = torch.randn(4, RESPONSE_LENGTH, generator=g, dtype=torch.float64)  # the loss's per-token weights
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        weights=weights,
    )
