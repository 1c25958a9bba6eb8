"""Train rows as a dock column (`prompt_row`, flow/columns.py): the driver, which loads the rows once, puts
each sample's row beside its prompt, and the stages that read a row (the reward, an agent's environment, a
harness's task) take it from the dock with the sample, so no worker reads the train files.

A row travels as its pickle, zero-padded to the longest of the job's rows, since a dock column keeps one
shape for the job: (B, W) uint8. Pickle, not JSON, because a row holds what its file held (a parquet file's
numpy values in `extra_info` and `columns` among it), and the dock's rows are written by the job's own
processes, which already trust each other's pickles (every Ray call is one). A row's pickle ends at its
STOP opcode, so the padding after it is never read.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rldock.runtime.data.rows import Row

if TYPE_CHECKING:  # the data package imports no torch: the driver's feed makes the tensor
    import torch


def row_bytes(row: Row) -> bytes:
    """What `row` is in the dock: its pickle."""
    return pickle.dumps(row, protocol=pickle.HIGHEST_PROTOCOL)


def padded_rows(encoded: Sequence[bytes], width: int) -> bytearray:
    """The rows `encoded` (`row_bytes`) as the dock's column's bytes, (len, `width`) row-major, each
    zero-padded (the driver's feed views them as the uint8 tensor)."""
    out = bytearray(len(encoded) * width)
    for i, data in enumerate(encoded):
        if len(data) > width:
            raise ValueError(f"a row of {len(data)} bytes does not fit the dock's prompt_row column of {width}")
        out[i * width : i * width + len(data)] = data
    return out


def rows_from_column(column: torch.Tensor) -> list[Row]:
    """The rows of the dock's column (B, W) uint8, one per sample (a group's N samples decoded once)."""
    decoded: dict[bytes, Row] = {}
    rows = []
    for data in column.numpy():
        key = data.tobytes()
        if key not in decoded:
            decoded[key] = pickle.loads(key)
        rows.append(decoded[key])
    return rows
