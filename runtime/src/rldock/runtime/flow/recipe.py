"""The recipe type and its registry: what one RL algorithm runs, as data, so the driver and the
workers never branch on `algorithm.name`.

A recipe names the worker states that run each iteration with the dock columns each consumes (the
dock is created from `consumes`, the driver launches exactly those states), the advantage stage that
turns the advantage state's columns into its outputs, and the registered policy loss the actor's
update calls. The recipes themselves are in catalogue.py, a job's rewrites of its recipe in
job_recipe.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from rldock.config.algorithm import AlgorithmSpec
from rldock.contract.algorithms import CATALOGUE
from rldock.runtime.flow.columns import PROMPT, PROMPT_DRAW, PROMPT_INDEX, PROMPT_ROW
from rldock.runtime.flow.states import CRITIC, ROLLOUT, SAMPLE_FACTS, WorkerState, worker_groups
from rldock.runtime.registry import Registry

# (batch columns of the advantage state, algorithm spec, generator for any sampling) -> the
# columns to write back, each with the batch's leading dimension B.
AdvantageStage = Callable[[Mapping[str, torch.Tensor], AlgorithmSpec, torch.Generator], dict[str, torch.Tensor]]


# Reward shaping applied by the reward stage: (rule rewards (B,), response lengths (B,), algorithm
# spec) -> the rewards written to the dock (B,).
RewardShaping = Callable[[torch.Tensor, torch.Tensor, AlgorithmSpec], torch.Tensor]


def _clip_ratio_kwargs(algo: AlgorithmSpec) -> dict:
    return {"clip_ratio": algo.clip_ratio, "clip_ratio_c": algo.clip_ratio_c}


def _unshaped(rewards: torch.Tensor, response_lengths: torch.Tensor, algo: AlgorithmSpec) -> torch.Tensor:
    return rewards


@dataclass(frozen=True)
class SamplingRounds:
    """States the driver runs in rounds before the rest (DAPO's dynamic sampling): each round puts
    fresh prompts into the dock's empty group slots, runs `states`, reads only `score_column` of
    them through `read_state` and keeps the groups `group_filter(algo)` accepts; the dock empties
    the other slots for the next round, until G groups are kept (runtime/src/rldock/runtime/driver/feed.py)."""

    states: tuple[str, ...]
    read_state: str
    group_filter: Callable[[AlgorithmSpec], Callable[[torch.Tensor, int], torch.Tensor]]
    score_column: str = "score"  # (B,) per sample, what the filter reads


@dataclass(frozen=True)
class Recipe:
    name: str
    # The worker states that run each iteration, in launch order (runtime/src/rldock/runtime/flow/states.py).
    specs: tuple[WorkerState, ...]
    advantage_stage: AdvantageStage | None  # None: the recipe has no advantage state (DPO)
    policy_loss: str | None  # a name in POLICY_LOSSES; None: the update state has its own loss (DPO)
    # keyword arguments of the policy loss besides the tensors, from the algorithm spec
    policy_loss_kwargs: Callable[[AlgorithmSpec], dict] = _clip_ratio_kwargs
    reward_shaping: RewardShaping = _unshaped
    # what the driver puts each iteration: "prompt_groups" (G prompts x N) or "preference_pairs"
    # (G chosen/rejected pairs), a name in runtime/src/rldock/runtime/driver/feed.py's BATCH_BUILDERS
    driver_batch: str = "prompt_groups"
    driver_produces: tuple[str, ...] = (
        PROMPT + PROMPT_INDEX + PROMPT_ROW + PROMPT_DRAW
    )  # the dock columns the driver puts
    sampling_rounds: SamplingRounds | None = None
    update_state: str = "update"  # the state whose results carry the training metrics
    # What one call of the advantage stage sees: "groups" (whole prompt groups, as they become
    # ready: GRPO's baselines need nothing else) or "iteration" (the iteration's whole batch, for
    # statistics over the batch such as PPO's advantage whitening, so the result does not depend
    # on how the dock happened to split the samples).
    advantage_scope: str = "groups"
    # The reference's logprobs feed only the KL penalty, so a job with kl_coef 0 skips the
    # reference state; False where the loss itself needs them (DPO).
    reference_for_kl_only: bool = True
    # The reward state also runs the advantage stage on each group it scores and writes both in one
    # dock write; there is no advantage state (`with_advantage_in_reward`; JobConfig.ablations turns it off).
    advantage_in_reward: bool = False
    # The advantage stage of `algorithm.credit: turn` (algorithms/turn_credit.py), which `with_turns` puts
    # in place of `advantage_stage`; None where the recipe has none (a critic's GAE reads algorithm.credit
    # itself; DAPO, DPO).
    turn_credit_stage: AdvantageStage | None = None

    @property
    def consumes(self) -> dict[str, tuple[str, ...]]:
        """Worker state -> the dock columns it needs (the dock's controllers, in launch order)."""
        return {spec.name: spec.consumes for spec in self.specs}

    @property
    def produces(self) -> dict[str, tuple[str, ...]]:
        """ "driver" and each worker state -> the columns it writes."""
        return {"driver": self.driver_produces, **{spec.name: spec.produces for spec in self.specs}}

    def spec(self, state: str) -> WorkerState:
        for spec in self.specs:
            if spec.name == state:
                return spec
        raise KeyError(f"recipe {self.name!r} has no state {state!r}; its states: {list(self.states)}")

    @property
    def launched_states(self) -> tuple[str, ...]:
        """States started together once the dock holds the iteration's batch (the driver's reads
        and the sampling rounds' states are not)."""
        rounds = self.sampling_rounds
        skip = (*rounds.states, rounds.read_state) if rounds else ()
        return tuple(spec.name for spec in self.specs if spec.group is not None and spec.name not in skip)

    @property
    def facts(self) -> WorkerState:
        """The driver's read of the samples' facts (states.SAMPLE_FACTS, its columns as this recipe
        writes them): what the iteration's record takes its rewards and response lengths from."""
        return self.spec(SAMPLE_FACTS.name)

    @property
    def training_states(self) -> tuple[str, ...]:
        """The launched states that train (the policy's update, the critic's): launched last."""
        return tuple(s for s in self.launched_states if self.spec(s).trains)

    @property
    def needs_rollout_engine(self) -> bool:
        return ROLLOUT.name in self.consumes

    @property
    def states(self) -> tuple[str, ...]:
        return tuple(self.consumes)

    @property
    def needs_critic(self) -> bool:
        return CRITIC.name in worker_groups(self.specs)

    @property
    def credits_turns(self) -> bool:
        """Whether the recipe can credit a multi-turn episode's turns apart (algorithm.credit: turn)."""
        return self.turn_credit_stage is not None or self.needs_critic

    @property
    def can_fuse_reward_advantage(self) -> bool:
        """Whether the reward state can run the advantage stage itself: the advantage reads only
        columns the reward reads or writes, over whole prompt groups (GRPO, DAPO; not PPO's GAE, which
        needs the critic's values and whitens over the iteration)."""
        if "advantage" not in self.consumes or "reward" not in self.consumes or self.advantage_scope != "groups":
            return False
        return set(self.consumes["advantage"]) <= {*self.produces["reward"], *self.consumes["reward"]}


RECIPES: Registry[Recipe] = Registry("algorithm", field="algorithm.name")


ADVANTAGE_SCOPES = ("groups", "iteration")


def register_recipe(recipe: Recipe) -> Recipe:
    """Register `recipe`; it must be in the contract's algorithm catalogue and agree with it (the
    operator counts devices from the catalogue without importing the runtime)."""
    if recipe.advantage_scope not in ADVANTAGE_SCOPES:
        raise ValueError(
            f"recipe {recipe.name!r}: advantage_scope {recipe.advantage_scope!r} is not one of {ADVANTAGE_SCOPES}"
        )
    traits = CATALOGUE.get(recipe.name)
    if traits is None:
        raise ValueError(f"recipe {recipe.name!r} is not in rldock.contract.algorithms.CATALOGUE")
    if SAMPLE_FACTS.name not in recipe.consumes:
        raise ValueError(f"recipe {recipe.name!r} has no {SAMPLE_FACTS.name} state: the driver reads its facts there")
    if (traits.needs_critic, traits.needs_rollout, traits.credits_turns) != (
        recipe.needs_critic,
        recipe.needs_rollout_engine,
        recipe.credits_turns,
    ):
        raise ValueError(f"recipe {recipe.name!r} disagrees with the algorithm catalogue: {traits}")
    return RECIPES.register(recipe.name)(recipe)
