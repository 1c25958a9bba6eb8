"""A warehouse as a plain object (no Ray): storage, wire dtypes, stale-read guard, counters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rldock.runtime.dock.warehouse import Warehouse
from rldock.runtime.dock.wire import WireColumn, from_wire, to_wire


def wire(**columns: torch.Tensor) -> dict[str, WireColumn]:
    return {name: to_wire(tensor) for name, tensor in columns.items()}


def test_write_then_read_any_column_name_in_index_order() -> None:
    warehouse = Warehouse(warehouse_id=1, start=8, capacity=8)
    ids = torch.arange(8 * 3).view(8, 3)  # (B, 3)
    warehouse.write(np.arange(8, 16), wire(prompt_ids=ids, my_custom_score=torch.linspace(0, 1, 8)))
    out = warehouse.read(np.array([15, 9, 10]), ["prompt_ids", "my_custom_score"])
    assert torch.equal(from_wire(out["prompt_ids"]), ids[[7, 1, 2]])
    assert torch.equal(from_wire(out["my_custom_score"]), torch.linspace(0, 1, 8)[[7, 1, 2]])


def test_read_of_a_run_is_a_view_of_storage() -> None:
    warehouse = Warehouse(warehouse_id=0, start=0, capacity=4)
    warehouse.write(np.arange(4), wire(x=torch.ones(4, 2)))
    first = warehouse.read(np.array([1, 2]), ["x"])["x"].array
    assert not first.flags.owndata  # ascending run: no copy before Ray serialises it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.float64])
def test_dtypes_round_trip(dtype: torch.dtype) -> None:
    warehouse = Warehouse(warehouse_id=0, start=0, capacity=4)
    values = (torch.arange(8).view(4, 2) % 3).to(dtype)
    warehouse.write(np.arange(4), wire(x=values))
    back = from_wire(warehouse.read(np.array([0, 3]), ["x"])["x"])
    assert back.dtype == dtype and torch.equal(back, values[[0, 3]])


def test_a_snapshot_whose_columns_name_torchs_dtype_object_restores() -> None:
    """Dock checkpoints written before the dtype travelled by name (dock/wire.py) hold torch.bfloat16
    itself; restored, the column is the same as one written now."""
    source = Warehouse(warehouse_id=0, start=0, capacity=4)
    values = torch.randn(4, 2).to(torch.bfloat16)
    source.write(np.arange(4), wire(x=values))
    snapshot = source.snapshot()
    indices, column = snapshot["columns"]["x"]
    snapshot["columns"]["x"] = (indices, WireColumn(column.array, torch.bfloat16))
    restored = Warehouse(warehouse_id=0, start=0, capacity=4)
    restored.restore(snapshot)
    back = from_wire(restored.read(np.arange(4), ["x"])["x"])
    assert back.dtype == torch.bfloat16 and torch.equal(back, values)
    restored.write(np.arange(2), wire(x=values[:2]))  # a write of today's form lands in the same column


def test_reading_an_unwritten_row_fails() -> None:
    warehouse = Warehouse(warehouse_id=0, start=0, capacity=4)
    warehouse.write(np.array([0, 1]), wire(x=torch.zeros(2)))
    with pytest.raises(ValueError, match="not written"):
        warehouse.read(np.array([1, 2]), ["x"])
    with pytest.raises(KeyError, match="never written"):
        warehouse.read(np.array([0]), ["y"])


def test_reset_forgets_writes_but_keeps_storage() -> None:
    warehouse = Warehouse(warehouse_id=0, start=0, capacity=4)
    warehouse.write(np.arange(4), wire(x=torch.zeros(4, 2)))
    warehouse.reset()
    with pytest.raises(ValueError, match="not written"):
        warehouse.read(np.array([0]), ["x"])
    assert warehouse.stats()["bytes_stored"] == 4 * 2 * 4


def test_shape_dtype_and_range_mismatches_are_refused() -> None:
    warehouse = Warehouse(warehouse_id=2, start=4, capacity=4)
    warehouse.write(np.array([4]), wire(x=torch.zeros(1, 3)))
    with pytest.raises(ValueError, match="per-sample shape"):
        warehouse.write(np.array([5]), wire(x=torch.zeros(1, 2)))
    with pytest.raises(ValueError, match="float32"):
        warehouse.write(np.array([5]), wire(x=torch.zeros(1, 3, dtype=torch.float64)))
    with pytest.raises(IndexError, match=r"\[4, 8\)"):
        warehouse.write(np.array([8]), wire(x=torch.zeros(1, 3)))
    with pytest.raises(ValueError, match="rows"):
        warehouse.write(np.array([5, 6]), wire(x=torch.zeros(1, 3)))


def test_counters_count_bytes_and_requests() -> None:
    warehouse = Warehouse(warehouse_id=0, start=0, capacity=4)
    warehouse.write(np.arange(4), wire(a=torch.zeros(4, 5), b=torch.zeros(4, dtype=torch.int64)))
    warehouse.read(np.array([0, 2]), ["a"])
    warehouse.read(np.array([1]), ["a", "b"])
    stats = warehouse.stats()
    assert stats["bytes_in"] == 4 * 5 * 4 + 4 * 8
    assert stats["bytes_out"] == 2 * 5 * 4 + 1 * 5 * 4 + 1 * 8
    assert (stats["write_requests"], stats["read_requests"]) == (1, 2)
    assert stats["columns"] == ["a", "b"]


def test_group_columns_are_expanded_to_every_sample_of_their_group() -> None:
    warehouse = Warehouse(warehouse_id=1, start=6, capacity=6, group_size=3)
    prompts = torch.tensor([[1, 2], [3, 4]])  # (k=2 groups, PL)
    responses = torch.arange(6 * 2).view(6, 2)  # (k*N, SL)
    warehouse.write(np.arange(6, 12), wire(response_ids=responses), wire(prompt_ids=prompts))
    out = warehouse.read(np.arange(6, 12), ["prompt_ids", "response_ids"])
    assert torch.equal(from_wire(out["prompt_ids"]), prompts.repeat_interleave(3, dim=0))
    assert torch.equal(from_wire(out["response_ids"]), responses)
    stats = warehouse.stats()
    # What crossed the wire is counted in: each prompt row once; the expansion is counted apart.
    assert stats["bytes_in"] == prompts.numpy().nbytes + responses.numpy().nbytes
    assert stats["expanded_bytes"] == prompts.numpy().nbytes * 2


def test_group_columns_of_scattered_groups_expand_in_group_order() -> None:
    warehouse = Warehouse(warehouse_id=0, start=0, capacity=8, group_size=2)
    warehouse.write(np.array([0, 1, 6, 7]), {}, wire(prompt_index=torch.tensor([10, 13])))
    out = warehouse.read(np.array([0, 1, 6, 7]), ["prompt_index"])
    assert from_wire(out["prompt_index"]).tolist() == [10, 10, 13, 13]


def test_group_columns_need_whole_groups() -> None:
    warehouse = Warehouse(warehouse_id=0, start=0, capacity=8, group_size=2)
    with pytest.raises(ValueError, match="whole groups of 2"):
        warehouse.write(np.array([1, 2]), {}, wire(prompt_index=torch.tensor([10])))
