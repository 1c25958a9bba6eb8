"""The stage loop's calls to the dock: it stops after the grant that drained its rank without one
more request, and between two batches it writes and asks for the next in one call (put_and_get)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.runtime.dock.stage_loop import run_stage
from rldock.runtime.flow.states import WorkerState

STAGE = WorkerState("s", None, "", consumes=("x",))  # a state reading column x


class CountingDock:
    """Test double of TransferDock: two batches of 2, the second marked as the rank's last
    (`drained`) when `says_drained`; counts requests, writes and calls (a put_and_get is one call)."""

    def __init__(self, *, says_drained: bool):
        self.says_drained, self.waited_s, self.drained = says_drained, 0.0, False
        self.requests, self.puts, self.calls = 0, 0, []

    def _grant(self):
        self.requests += 1
        if self.requests > 2:
            self.drained = True
            return None
        self.drained = self.says_drained and self.requests == 2
        indices = torch.arange(2 * self.requests - 2, 2 * self.requests)
        return indices, TensorDict({"x": indices.float()}, batch_size=[2])

    def get(self, state, columns, **request):
        self.calls.append("get")
        return self._grant()

    def put(self, indices, out, *, policy_version=None):
        self.calls.append("put")
        self.puts += 1

    def put_and_get(self, indices, out, state, columns, *, policy_version=None, **request):
        self.calls.append("put_and_get")
        self.puts += 1
        return self._grant()


def copy_x(indices, batch):
    return TensorDict({"y": batch["x"]}, batch_size=[len(indices)])


def test_a_drained_grant_ends_the_loop_without_another_request():
    dock = CountingDock(says_drained=True)
    timing = run_stage(dock, STAGE, copy_x, rank=0, batch_size=2)
    assert (timing.num_samples, dock.requests, dock.puts) == (4, 2, 2)
    assert dock.calls == ["get", "put_and_get", "put"]


def test_without_the_flag_the_loop_asks_until_exhausted():
    dock = CountingDock(says_drained=False)
    timing = run_stage(dock, STAGE, lambda i, b: None, rank=0, batch_size=2)
    assert (timing.num_samples, dock.requests, dock.puts) == (4, 3, 0)
    assert dock.calls == ["get", "get", "get"]


def test_a_write_and_the_next_request_are_one_call():
    """Two batches with outputs and no drained flag: 3 calls where put-then-get made 5."""
    dock = CountingDock(says_drained=False)
    timing = run_stage(dock, STAGE, copy_x, rank=0, batch_size=2)
    assert (timing.num_samples, dock.requests, dock.puts) == (4, 3, 2)
    assert dock.calls == ["get", "put_and_get", "put_and_get"]


def test_a_rank_with_its_share_writes_without_asking_again():
    dock = CountingDock(says_drained=False)
    timing = run_stage(dock, STAGE, copy_x, rank=0, batch_size=2, max_batches=1)
    assert (timing.num_samples, dock.calls) == (2, ["get", "put"])
    assert (
        run_stage(CountingDock(says_drained=False), STAGE, copy_x, rank=0, batch_size=2, max_batches=0).num_samples == 0
    )
