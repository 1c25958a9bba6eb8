"""split_group_columns: which driver columns may cross the wire once per group."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rldock.runtime.dock.grouping import split_group_columns


def test_prompt_columns_go_per_group_and_responses_per_sample() -> None:
    prompts = torch.tensor([[1, 2], [3, 4]])  # (G, PL)
    responses = torch.arange(4 * 3).view(4, 3)  # (G*N, SL), differ within each group
    batch = TensorDict({"prompt_ids": prompts.repeat_interleave(2, dim=0), "response_ids": responses}, batch_size=[4])
    shared, per_sample = split_group_columns(batch, 2)
    assert list(shared.keys()) == ["prompt_ids"] and torch.equal(shared["prompt_ids"], prompts)
    assert list(per_sample.keys()) == ["response_ids"] and torch.equal(per_sample["response_ids"], responses)


def test_a_column_differing_in_one_group_only_stays_per_sample() -> None:
    index = torch.tensor([7, 7, 8, 9])  # group 1 is not constant
    shared, per_sample = split_group_columns(TensorDict({"prompt_index": index}, batch_size=[4]), 2)
    assert len(shared.keys()) == 0 and torch.equal(per_sample["prompt_index"], index)


def test_all_shared_gives_no_per_sample_part() -> None:
    shared, per_sample = split_group_columns(TensorDict({"x": torch.ones(6)}, batch_size=[6]), 3)
    assert per_sample is None and shared.batch_size == torch.Size([2])


def test_rows_that_are_not_whole_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="not whole groups of 4"):
        split_group_columns(TensorDict({"x": torch.ones(6)}, batch_size=[6]), 4)
