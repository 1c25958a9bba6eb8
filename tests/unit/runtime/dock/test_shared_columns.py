"""A warehouse's columns in shared memory (Ray-free): the owner allocates, attached processes read
and write the same rows, flags and counters; fallbacks to private memory; orphaned directories."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from rldock.runtime.dock import shared_columns
from rldock.runtime.dock.shared_columns import process_runs, remove_orphans
from rldock.runtime.dock.warehouse import Warehouse
from rldock.runtime.dock.wire import WireColumn, from_wire, to_wire

WHERE = {"warehouse_id": 1, "start": 8, "capacity": 8, "group_size": 2}


def wire(values) -> WireColumn:
    return to_wire(torch.as_tensor(values))


def owner_and_attached(root) -> tuple[Warehouse, Warehouse]:
    owner = Warehouse(**WHERE, shared_root=str(root))
    return owner, Warehouse.attach(owner.shared_directory(), **WHERE)


def test_an_attached_warehouse_reads_and_writes_the_owners_rows(tmp_path) -> None:
    owner, attached = owner_and_attached(tmp_path)
    indices = np.arange(8, 12)
    assert not attached.can_write({"ids": wire(torch.zeros(4, 3, dtype=torch.int64))})  # not allocated yet
    owner.write(indices, {"ids": wire(torch.arange(12).view(4, 3))})  # the first write allocates
    assert attached.can_write({"ids": wire(torch.zeros(4, 3, dtype=torch.int64))})
    # other shape: the owner says why
    assert not attached.can_write({"ids": wire(torch.zeros(4, 2, dtype=torch.int64))})
    assert not attached.can_write({"ids": wire(torch.zeros(4, 3, dtype=torch.int32))})
    np.testing.assert_array_equal(attached.read(indices, ["ids"])["ids"].array, np.arange(12).reshape(4, 3))
    attached.write(np.arange(12, 16), {"ids": wire(torch.arange(100, 112).view(4, 3))})
    np.testing.assert_array_equal(
        owner.read(np.arange(12, 16), ["ids"])["ids"].array, np.arange(100, 112).reshape(4, 3)
    )
    stats = owner.stats()
    assert stats["shared_memory"] and stats["columns"] == ["ids"]
    assert (stats["write_requests"], stats["shared_write_requests"]) == (2, 1)
    assert (stats["read_requests"], stats["shared_read_requests"]) == (2, 1)
    assert stats["bytes_in"] == stats["bytes_out"] == 2 * 12 * 8
    assert attached.stats()["bytes_in"] == stats["bytes_in"]  # one set of counters, in shared memory


def test_a_copied_read_does_not_change_when_the_rows_are_written_again(tmp_path) -> None:
    owner, attached = owner_and_attached(tmp_path)
    owner.write(np.arange(8, 16), {"x": wire(torch.arange(8.0))})
    copied, viewed = attached.read(np.arange(8, 16), ["x"], copy=True)["x"], attached.read(np.arange(8, 16), ["x"])["x"]
    owner.write(np.arange(8, 16), {"x": wire(-torch.arange(8.0))})
    np.testing.assert_array_equal(copied.array, np.arange(8.0))
    np.testing.assert_array_equal(viewed.array, -np.arange(8.0))  # a view is the storage itself


def test_written_flags_are_shared_so_reset_and_snapshots_see_attached_writes(tmp_path) -> None:
    owner, attached = owner_and_attached(tmp_path)
    owner.write(np.arange(8, 10), {"r": wire(torch.zeros(2))})
    attached.write(np.arange(10, 14), {"r": wire(torch.arange(1.0, 5.0))})
    snapshot = owner.snapshot()
    rows, column = snapshot["columns"]["r"]
    assert rows.tolist() == [8, 9, 10, 11, 12, 13]  # the attached write is in the owner's checkpoint
    np.testing.assert_array_equal(column.array, [0, 0, 1, 2, 3, 4])
    owner.reset()
    with pytest.raises(ValueError, match="not written this iteration"):
        attached.read(np.arange(10, 12), ["r"])


def test_group_columns_and_bfloat16_through_an_attached_warehouse(tmp_path) -> None:
    owner, attached = owner_and_attached(tmp_path)
    prompts, half = wire(torch.tensor([[1, 2], [3, 4]])), wire(torch.tensor([0.5, 1.5, 2.5, 3.5], dtype=torch.bfloat16))
    owner.write(np.arange(8, 12), {"h": half}, {"p": prompts})
    attached.write(np.arange(12, 16), {"h": half}, {"p": prompts})
    read = attached.read(np.arange(8, 16), ["p", "h"])
    assert from_wire(read["h"]).dtype == torch.bfloat16
    assert from_wire(read["h"]).tolist() == [0.5, 1.5, 2.5, 3.5] * 2
    np.testing.assert_array_equal(read["p"].array, [[1, 2], [1, 2], [3, 4], [3, 4]] * 2)
    assert owner.stats()["expanded_bytes"] == 2 * prompts.array.nbytes  # N - 1 = 1 copy per group, twice


def test_another_process_writes_what_the_owner_reads(tmp_path) -> None:
    owner = Warehouse(**WHERE, shared_root=str(tmp_path))
    owner.write(np.arange(8, 16), {"x": wire(torch.zeros(8, 2, dtype=torch.int32))})
    owner.reset()
    script = (
        "import numpy as np, torch\n"
        "from rldock.runtime.dock.warehouse import Warehouse\n"
        "from rldock.runtime.dock.wire import to_wire\n"
        f"w = Warehouse.attach({owner.shared_directory()!r}, **{WHERE!r})\n"
        "w.write(np.arange(8, 16), {'x': to_wire(torch.arange(16, dtype=torch.int32).view(8, 2))})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    np.testing.assert_array_equal(owner.read(np.arange(8, 16), ["x"])["x"].array, np.arange(16).reshape(8, 2))
    assert owner.stats()["shared_write_requests"] == 1


def test_a_column_without_room_in_shared_memory_stays_private(tmp_path, monkeypatch) -> None:
    owner, attached = owner_and_attached(tmp_path)
    owner.write(np.arange(8, 16), {"small": wire(torch.zeros(8))})

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shared_columns.os, "posix_fallocate", full)
    owner.write(np.arange(8, 16), {"big": wire(torch.arange(8.0))})
    np.testing.assert_array_equal(owner.read(np.arange(8, 16), ["big"])["big"].array, np.arange(8.0))
    assert attached.has_columns(["small"]) and not attached.has_columns(["big"])  # callers go to the owner
    assert not attached.can_write({"big": wire(torch.zeros(8))})
    assert sorted(p.name for p in owner._shared.directory.iterdir()) == [
        "0.rows",
        "0.written",
        "columns.json",
        "counters",
        "owner",
    ]  # nothing half-made left


def test_without_a_shared_root_the_warehouse_keeps_private_memory(tmp_path) -> None:
    warehouse = Warehouse(**WHERE, shared_root=str(tmp_path / "missing"))
    assert warehouse.shared_directory() is None
    warehouse.write(np.arange(8, 10), {"x": wire(torch.ones(2))})
    stats = warehouse.stats()
    assert not stats["shared_memory"] and stats["bytes_in"] == 8 and stats["shared_write_requests"] == 0


def test_close_removes_the_directory_and_orphans_of_dead_owners_are_swept(tmp_path) -> None:
    owner, attached = owner_and_attached(tmp_path)
    owner.write(np.arange(8, 16), {"x": wire(torch.ones(8))})
    directory = owner._shared.directory
    assert attached.owner_alive() and attached.owner_pid == os.getpid()
    owner.close()
    assert not directory.exists()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    orphan, alive, foreign = tmp_path / "rldock-orphan", tmp_path / "rldock-alive", tmp_path / "other"
    for path, pid in ((orphan, dead), (alive, str(os.getpid())), (foreign, dead)):
        path.mkdir()
        (path / "owner").write_text(pid)
    assert remove_orphans(tmp_path) == [orphan]
    assert alive.exists() and foreign.exists()


def test_an_attached_warehouse_tells_when_its_owner_is_gone(tmp_path) -> None:
    owner, attached = owner_and_attached(tmp_path)
    dead = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        ).stdout
    )
    attached._shared.owner_pid = dead
    assert not attached.owner_alive()
    assert owner_and_attached(tmp_path)[1].owner_alive()


def test_a_directory_this_process_cannot_open_leaves_the_rows_to_ray_calls(tmp_path) -> None:
    from rldock.runtime.dock import distributed

    gone = str(tmp_path / "rldock-gone")
    assert distributed._attach(gone, warehouse_id=0, start=0, capacity=4, group_size=1) is None
    distributed._ATTACHED.pop(gone)


def test_a_process_reaped_between_the_open_and_the_read_is_not_running(monkeypatch):
    """The kernel answers the read of an open /proc/<pid>/stat with ESRCH once the process is reaped (a
    killed actor's, its raylet reaping it while a worker asks)."""

    def reaped(fd, size):
        raise ProcessLookupError(3, "No such process")

    assert process_runs(os.getpid())
    monkeypatch.setattr(shared_columns.os, "read", reaped)
    assert not process_runs(os.getpid())
