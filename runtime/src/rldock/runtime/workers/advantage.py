"""The advantage worker state: the recipe's advantage stage (GRPO's group-normalised advantages,
PPO's GAE, ...) over whole prompt groups, or over the iteration's whole batch when the recipe's
stage takes statistics over the batch (PPO's whitening). Where the recipe fuses the advantage into
the reward state (JobConfig.ablations.fuse_reward_advantage) this worker does not exist: the reward worker
runs the same stage (workers/reward.py)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult, run_stage
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import ADVANTAGE_STATE, StageCall


def advantage_batch_size(recipe: Recipe, cfg: JobConfig) -> int:
    """Samples per dock request of the advantage state: whole groups, as many as fit a micro-batch,
    or every sample of the iteration (`advantage_scope: iteration`)."""
    if recipe.advantage_scope == "iteration":
        return cfg.num_samples_per_iteration
    group = cfg.rows_per_group
    return group * max(1, cfg.training.micro_batch_size // group)


def advantage_generator(seed: int, iteration: int, indices: torch.Tensor) -> torch.Generator:
    """The generator of any sampling in the advantage stage (PF-PPO's best_random), keyed by (seed,
    iteration, first sample of the batch), so a resumed run draws the same as the original did."""
    return torch.Generator().manual_seed(hash((seed, iteration, int(indices[0]))) % 2**63)


class AdvantageWorker:
    def __init__(self, cfg: JobConfig, *, recipe: Recipe, banks: DockBanks):
        self.cfg, self.banks = cfg, banks
        self.spec = recipe.spec(ADVANTAGE_STATE.name)  # the dock columns it reads, as the job runs it
        # Only a recipe with an advantage stage has the advantage state this worker serves.
        assert recipe.advantage_stage is not None, f"recipe {recipe.name!r} has no advantage stage"
        self.stage = recipe.advantage_stage
        self.batch_size = advantage_batch_size(recipe, cfg)

    def compute_advantages(self, call: StageCall) -> StageResult:
        algo = self.cfg.algorithm

        def estimate(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            columns = self.stage(batch, algo, advantage_generator(self.cfg.seed, call.iteration, indices))
            return TensorDict(columns, batch_size=[len(indices)])

        # Whole groups only: a group's baseline needs all N of its rewards.
        return run_stage(
            self.banks.bank(call.iteration),
            self.spec,
            estimate,
            rank=0,
            batch_size=self.batch_size,
            whole_groups=True,
        )
