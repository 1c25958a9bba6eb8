"""`run_shared_stage` on two real gloo ranks (torch.multiprocessing): the group's reader alone asks the
dock, every rank runs the stage on the reader's batches in its order, and only the reader writes the
results back, as a TP or CP group's ranks need (training/backend.py). The dock is a test double
holding three batches (`_DockDouble`), since only its get/put calls are under test."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import rank_processes
import torch
import torch.distributed as dist
from dock_double_base import PutThenGet  # tests/dock_double_base.py
from tensordict import TensorDict

pytestmark = pytest.mark.ranks

BATCHES = [torch.arange(0, 4), torch.arange(4, 6), torch.arange(6, 9)]  # dock indices of three batches


class _DockDouble(PutThenGet):
    """Hands out BATCHES in order to whoever asks, then None; records what was asked and written."""

    def __init__(self) -> None:
        self.waited_s, self.drained = 0.0, False
        self.asked: list[int] = []  # the rank each get named
        self.written: list[list[int]] = []

    def get(self, state, columns, *, rank, **_):
        self.asked.append(rank)
        if len(self.asked) > len(BATCHES):
            return None
        indices = BATCHES[len(self.asked) - 1]
        return indices, TensorDict({"x": indices.float()}, batch_size=[len(indices)])

    def put(self, indices, out, *, policy_version=None) -> None:
        self.written.append(indices.tolist())


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.training.backend import run_shared_stage

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    dock, seen = _DockDouble(), []

    def stage(indices, batch):
        seen.append(indices.tolist())
        return TensorDict({"y": batch["x"] * 2}, batch_size=[len(indices)])

    spec = SimpleNamespace(name="update", consumes=("x",))
    timing = run_shared_stage(dock, spec, stage, group=dist.group.WORLD, reader=0, dp_rank=3, batch_size=4)
    record = dict(asked=dock.asked, written=dock.written, seen=seen, num_samples=timing.num_samples)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def test_the_reader_reads_and_writes_and_every_rank_runs_its_batches(tmp_path):
    rank_processes.spawn(_rank, args=(str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2)
    reader, peer = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    batches = [b.tolist() for b in BATCHES]
    assert reader["asked"] == [3] * (len(BATCHES) + 1)  # as data-parallel rank 3, until the dock says none
    assert peer["asked"] == [] and peer["written"] == []
    assert reader["seen"] == peer["seen"] == reader["written"] == batches
    assert reader["num_samples"] == peer["num_samples"] == 9
