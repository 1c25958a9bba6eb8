"""The advantage worker state: GRPO group-normalised advantages from whole groups of rewards."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.algorithms import get_advantage_estimator
from rldock.runtime.dataflow import CONSUMES
from rldock.runtime.dock import TransferDock
from rldock.runtime.workers.stage_loop import run_stage


class AdvantageWorker:
    def __init__(self, cfg: JobConfig, *, dock: TransferDock):
        self.cfg, self.dock = cfg, dock
        self.estimator = get_advantage_estimator(cfg.algorithm.name)

    def compute_advantages(self, iteration: int) -> dict:
        group = self.cfg.algorithm.num_responses_per_prompt

        def estimate(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            advantages = self.estimator(batch["reward"], group)  # (B,)
            return TensorDict({"advantage": advantages}, batch_size=[len(indices)])

        # Whole groups only: a group's baseline needs all N of its rewards.
        return run_stage(self.dock, "advantage", CONSUMES["advantage"], estimate, rank=0,
                         batch_size=group * max(1, self.cfg.training.micro_batch_size // group),
                         whole_groups=True).as_dict()
