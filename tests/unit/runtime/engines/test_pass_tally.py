"""What a stage's passes computed (engines/policy.PassTally), as the workers return it for the
`mfu/` metrics: real tokens and attended pairs per pass, padding left out."""

from __future__ import annotations

import torch

from rldock.runtime.engines.policy import PassTally
from rldock.runtime.engines.values import response_values


def test_the_value_passes_count_each_rows_real_tokens():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])  # (3, 3) left-padded: 2, 3, 1 tokens
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]])  # (3, 4) right-padded: 2, 1, 4
    ids = torch.ones(3, 3, dtype=torch.int64), torch.ones(3, 4, dtype=torch.int64)
    tally = PassTally()

    def value_model(input_ids, attention_mask, position_ids):  # a stand-in: V = 0 everywhere
        return torch.zeros(input_ids.shape)

    values = response_values(
        value_model, ids[0], prompt_mask, ids[1], response_mask, micro_batch_size=2, trim=True, tally=tally
    )
    assert values.shape == (3, 4)
    rows = [2 + 2, 3 + 1, 1 + 4]  # prompt + response tokens per row, whatever pass each is in
    assert tally.as_dict() == {
        "tokens": sum(rows),
        "pairs": sum(n * (n + 1) // 2 for n in rows),
        "head_positions": 0,  # the value head is left out of the count
    }
