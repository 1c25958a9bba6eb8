"""The advantage worker's output must not depend on how the dock splits the iteration's samples
into requests (PPO's whitening is over the whole batch, as in verl)."""

from __future__ import annotations

import pytest
import torch
from dock_double_base import PutThenGet  # tests/dock_double_base.py
from tensordict import TensorDict

from rldock.config.job import JobConfig
from rldock.runtime.flow.catalogue import get_recipe
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import StageCall
from rldock.runtime.workers.advantage import AdvantageWorker, advantage_batch_size

G, N, SL = 4, 2, 5


class ScriptedDock(PutThenGet):
    """Test double of TransferDock for one consumer: hands out samples in index order, at most
    `max_hand_out` per request (a dock whose samples become ready a few at a time), and records puts."""

    def __init__(self, batch: TensorDict, *, max_hand_out: int):
        self.batch, self.max_hand_out, self.next, self.waited_s = batch, max_hand_out, 0, 0.0
        self.drained = False  # never says so: the consumer asks until it hears None
        self.states = {"advantage": ("reward", "values", "response_mask")}
        self.written: dict[str, torch.Tensor] = {}

    def bank(self, iteration):  # stands in for DockBanks too: a single bank, itself
        return self

    def get(self, state, columns, *, rank, batch_size, whole_groups, balance_ranks, timeout_s):
        if self.next == len(self.batch):
            return None
        stop = min(self.next + batch_size, self.next + self.max_hand_out, len(self.batch))
        indices = torch.arange(self.next, stop)
        self.next = stop
        return indices, self.batch[indices].select(*columns)

    def put(self, indices, out, *, policy_version=None):
        for name, value in out.items():
            self.written.setdefault(name, torch.zeros(len(self.batch), *value.shape[1:], dtype=value.dtype))[
                indices
            ] = value


def _cfg(name: str, micro_batch_size: int) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        training={"micro_batch_size": micro_batch_size},
        algorithm={
            "name": name,
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": 4,
            "max_response_length": SL,
            "learning_rate": 0.0,
        },
    )


def _batch() -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([5, 3, 4, 1, 2, 5, 3, 4])  # (B,)
    mask = (torch.arange(SL) < lengths[:, None]).long()  # (B, SL)
    return TensorDict(
        {
            "reward": torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0]),
            "values": torch.randn(G * N, SL, generator=gen) * mask,
            "response_mask": mask,
        },
        batch_size=[G * N],
    )


def _advantages(name: str, *, micro_batch_size: int, max_hand_out: int) -> dict[str, torch.Tensor]:
    dock = ScriptedDock(_batch(), max_hand_out=max_hand_out)
    worker = AdvantageWorker(_cfg(name, micro_batch_size), recipe=job_recipe(_cfg(name, micro_batch_size)), banks=dock)
    worker.compute_advantages(StageCall(1))
    assert dock.next == G * N
    return dock.written


@pytest.mark.parametrize("name", ["ppo", "pf_ppo"])
def test_ppo_advantages_do_not_depend_on_the_split_into_dock_requests(name):
    whole = _advantages(name, micro_batch_size=G * N, max_hand_out=G * N)
    for micro_batch_size in (N, 2 * N):
        split = _advantages(name, micro_batch_size=micro_batch_size, max_hand_out=G * N)
        for column in ("advantage", "returns"):
            torch.testing.assert_close(split[column], whole[column], rtol=0, atol=0)
    # whitened over the batch: zero mean over its response tokens
    mask = _batch()["response_mask"].bool()
    if name == "ppo":
        assert abs(float(whole["advantage"][mask].mean())) < 1e-6


def test_ppo_asks_the_dock_for_the_whole_iteration_grpo_for_whole_groups():
    assert advantage_batch_size(get_recipe("ppo"), _cfg("ppo", 2)) == G * N
    assert advantage_batch_size(get_recipe("grpo"), _cfg("grpo", 5)) == 2 * N
