"""The stage loop stops after the grant that drained its rank, without one more request."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.runtime.dock.stage_loop import run_stage
from rldock.runtime.flow.states import WorkerState

STAGE = WorkerState("s", None, "", consumes=("x",))  # a state reading column x


class CountingDock:
    """Test double of TransferDock: two batches of 2, the second marked as the rank's last
    (`drained`) when `says_drained`; counts requests."""

    def __init__(self, *, says_drained: bool):
        self.says_drained, self.requests, self.waited_s, self.drained, self.puts = says_drained, 0, 0.0, False, 0

    def get(self, state, columns, **kwargs):
        self.requests += 1
        if self.requests > 2:
            self.drained = True
            return None
        self.drained = self.says_drained and self.requests == 2
        indices = torch.arange(2 * self.requests - 2, 2 * self.requests)
        return indices, TensorDict({"x": indices.float()}, batch_size=[2])

    def put(self, indices, out, *, policy_version=None):
        self.puts += 1


def test_a_drained_grant_ends_the_loop_without_another_request():
    dock = CountingDock(says_drained=True)
    timing = run_stage(dock, STAGE, lambda i, b: TensorDict({"y": b["x"]}, batch_size=[len(i)]), rank=0, batch_size=2)
    assert (timing.num_samples, dock.requests, dock.puts) == (4, 2, 2)


def test_without_the_flag_the_loop_asks_until_exhausted():
    dock = CountingDock(says_drained=False)
    timing = run_stage(dock, STAGE, lambda i, b: None, rank=0, batch_size=2)
    assert (timing.num_samples, dock.requests, dock.puts) == (4, 3, 0)
