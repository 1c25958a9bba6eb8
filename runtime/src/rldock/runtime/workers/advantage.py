"""The advantage worker state: the recipe's advantage stage (GRPO's group-normalised advantages,
PPO's GAE, ...) over whole prompt groups."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.algorithms.recipes import get_recipe
from rldock.runtime.dock import TransferDock
from rldock.runtime.workers.stage_loop import run_stage


class AdvantageWorker:
    def __init__(self, cfg: JobConfig, *, dock: TransferDock):
        self.cfg, self.dock = cfg, dock
        self.stage = get_recipe(cfg.algorithm.name).advantage_stage

    def compute_advantages(self, iteration: int) -> dict:
        algo = self.cfg.algorithm
        group = algo.num_responses_per_prompt

        def estimate(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            # Any sampling in the stage (PF-PPO's best_random) is keyed by (seed, iteration, first
            # sample), so a resumed run draws the same as the original did.
            generator = torch.Generator().manual_seed(hash((self.cfg.seed, iteration, int(indices[0]))) % 2**63)
            columns = self.stage(batch, algo, generator)
            return TensorDict(columns, batch_size=[len(indices)])

        # Whole groups only: a group's baseline needs all N of its rewards.
        return run_stage(self.dock, "advantage", self.dock.states["advantage"], estimate, rank=0,
                         batch_size=group * max(1, self.cfg.training.micro_batch_size // group),
                         whole_groups=True).as_dict()
