"""Which columns of a batch are the same for every sample of a group: those cross the wire once per group.

The driver's GRPO batch repeats each prompt (and its train-file row) for the N samples of its
group. Sending those rows N times made the driver's link the busiest of the cluster
(docs/dock-benchmarks.md); the dock instead takes them once per group and the owning warehouse
expands them (warehouse.py). The split is exact, not a guess: a column goes per group only if
every group's rows are identical, so expanding it gives back the batch bit for bit.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict


def split_group_columns(batch: TensorDict, group_size: int) -> tuple[TensorDict, TensorDict | None]:
    """(columns equal within every group, one row per group [k]; the other columns [k*N] or None).

    `batch` has batch size [k * group_size] with each group's samples consecutive.
    """
    num_rows = batch.batch_size[0] if batch.batch_size else 0
    if group_size < 1 or num_rows % group_size:
        raise ValueError(f"a batch of {num_rows} rows is not whole groups of {group_size}")
    num_groups = num_rows // group_size
    shared, per_sample = {}, {}
    for name, column in batch.items():
        assert isinstance(column, torch.Tensor)  # dock batches are flat: one tensor per column
        grouped = column.reshape(num_groups, group_size, *column.shape[1:])  # (k, N, ...)
        if torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
            shared[name] = grouped[:, 0]  # (k, ...)
        else:
            per_sample[name] = column
    return (
        TensorDict(shared, batch_size=[num_groups]),
        TensorDict(per_sample, batch_size=[num_rows]) if per_sample else None,
    )
