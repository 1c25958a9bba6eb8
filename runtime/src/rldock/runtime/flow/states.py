"""One spec per worker state: which worker runs it, the method the trainer calls, the dock columns
it reads and writes, whether it trains, where its workers sit and which memory model sizes them.

A recipe (flow/catalogue.py) is a tuple of these specs; everything that used to key on a
state's name reads them instead: the dock's controllers (`consumes`), the trainer's worker groups
and launches (`group`, `method`), the placement plan (`group.ranks`, `group.device`), the serial
phase schedule (which workers run a state, `trains` puts it last), the memory planner
(`group.memory`) and the checkpoint's save and restore (`group.checkpoint`). Adding a state is one
`WorkerState` here and one worker class (see docs/architecture.md, "Adding a worker state").

Pure data, no torch and no Ray: the planner and the placement read it without either. Worker
classes are named by import path and imported only where the trainer starts them
(`WorkerGroup.worker_class`), since the workers themselves import the recipes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from rldock.config import JobConfig
from rldock.config.job_layout import job_layout
from rldock.contract.layout import DeviceGroup, JobLayout, RankCount
from rldock.contract.placement import ACTOR_GROUP, PlacementPlan
from rldock.runtime.checkpoint import CRITIC_FILE, CRITIC_OPTIMIZER_FILE, OPTIMIZER_FILE, POLICY_DIR
from rldock.runtime.flow.columns import (
    POLICY_VERSION,
    PROMPT,
    PROMPT_DRAW,
    PROMPT_ROW,
    RESPONSE,
    RESPONSE_LENGTH,
    RM_SCORE,
)

if TYPE_CHECKING:
    from tensordict import TensorDict


@dataclass(frozen=True)
class WorkerContext:
    """What the trainer hands every worker group's constructor arguments (`WorkerGroup.arguments`)."""

    cfg: JobConfig
    recipe: object  # the job's Recipe (flow/job_recipe.py: job_recipe), built once by the driver
    banks: object  # the DockBanks every stage reads and writes through
    policy_dir: str  # the policy the actor ranks start from (a checkpoint's when resuming)
    reference_dir: str  # the initial policy: the reference, the critic's body, the tokenizer
    adapter_dir: str | None  # LoRA: the adapters the actor ranks resume with
    policy_version: int  # weight updates behind the actor ranks' starting policy
    # The environment servers the trainer started (servers.command), by config field ("agent.environment",
    # "agent.sandbox") -> their base URLs.
    environment_urls: Mapping[str, Sequence[str]] = field(default_factory=dict)


# (context, rank, number of ranks) -> the worker class's constructor keyword arguments
Arguments = Callable[[WorkerContext, int, int], dict]


@dataclass(frozen=True)
class CheckpointState:
    """A worker group's part of a checkpoint (rldock.runtime.checkpoint's folder), which its worker class writes
    and reads itself (`CheckpointWorker`). The driver names no group: it asks every rank of each group of the
    recipe that declares one to save, in the recipe's order, and a resumed attempt's new ranks to restore
    (driver/attempt.py: `Attempt.save`, `Attempt.restore`)."""

    # What its ranks always write there, files or folders; a resume refuses a checkpoint that lacks one (a
    # worker may write more beside them: TP's optimizer shards, LoRA's adapters).
    files: tuple[str, ...]
    # The key under which the checkpoint's rng.pt keeps its ranks' own states (what each rank's `save`
    # returns, gathered by the driver into one file, handed back to the same rank's `restore`); None: none.
    rank_states: str | None = None


class CheckpointWorker(Protocol):
    """The two methods of a worker class whose group declares a `CheckpointState`."""

    def save(self, staging_dir: str) -> object:
        """Write this rank's part of the group's files into `staging_dir` (collective where the group's
        training state is sharded: every rank is called at once); return the rank's own state for rng.pt
        (`CheckpointState.rank_states`), or None."""
        ...

    def restore(self, checkpoint_dir: str, rank_state: object) -> None:
        """Load this rank's part from the checkpoint in `checkpoint_dir` (collective where sharded), and the
        state its `save` returned (None where the group keeps none)."""
        ...


@dataclass(frozen=True)
class WorkerGroup:
    """The Ray actors one or more states run on: one per rank, each running every state of the
    group in the order they are launched (Ray runs one actor's calls in submission order)."""

    name: str  # "actor", "reference", ...: the workers are "<name> <rank>" in the placement plan
    worker: str  # "package.module:Class", imported where the trainer starts it (worker_class)
    arguments: Arguments
    # How many ranks: every actor rank (TP x DP), one per data-parallel rank, or one (JobLayout.num_ranks).
    ranks: RankCount = "one"
    device: bool = True  # a seat on a device share in the placement group; False: a CPU actor beside it
    collective: bool = False  # its ranks form a DDP group: joined at start, never two on one device
    # Its ranks form a group only when CP or PP splits its passes (the reference's CP attention and stages).
    collective_when_split: bool = False
    # Which of planning/memory.py's models sizes its devices: "actor", "critic"; None: not planned.
    memory: Literal["actor", "critic"] | None = None
    # What it keeps in a checkpoint (its worker class is a CheckpointWorker); None: nothing, it starts anew.
    checkpoint: CheckpointState | None = None

    def worker_class(self) -> type:
        module, _, name = self.worker.partition(":")
        return getattr(importlib.import_module(module), name)

    def num_ranks(self, cfg: JobConfig) -> int:
        return job_layout(cfg).num_ranks(self.ranks)

    def joins_group(self, cfg: JobConfig) -> bool:
        """Whether its ranks form a torch.distributed group of their own in `cfg`'s job (`collective`)."""
        training = cfg.training
        split = training.context_parallel_size > 1 or training.pipeline_parallel_size > 1
        return self.collective or (self.collective_when_split and split)


@dataclass(frozen=True)
class WorkerState:
    """One worker state: the group whose ranks run it, the method the trainer calls on them with the
    iteration, and the dock columns it reads (the dock hands a sample out only once all are ready)
    and writes."""

    name: str
    group: WorkerGroup | None  # None: no worker runs it, the driver reads it (sample_facts)
    method: str
    consumes: tuple[str, ...]
    produces: tuple[str, ...] = ()
    trains: bool = False  # an update: launched after the other states, and last in the phase order
    # "ranks": every rank of the group; "engines": each generation replica's first actor rank; "pool": the
    # rollout pool's engines alone (rollout.pool.actors_generate false), which are no rank of a group
    runs_on: Literal["ranks", "engines", "pool"] = "ranks"


@dataclass(frozen=True)
class StageCall:
    """The one argument of every stage method: which iteration, and for the rollout DAPO's sampling
    round (each round's groups get their own sampling seeds) and partial rollout's token budget
    when a weight update follows (None: generate whole responses), and carried episodes' prompts
    handed ahead at an attempt's first iteration (`ahead`: one row per group, the driver's prompt
    columns; driver/schedule/sync.py). The driver launches every state of a round with the same call;
    a stage reads what it needs of it."""

    iteration: int
    sampling_round: int = 0
    round_tokens: int | None = None
    ahead: TensorDict | None = None


# --- worker groups -------------------------------------------------------------------------------


def _actor_arguments(ctx: WorkerContext, rank: int, world_size: int) -> dict:
    return {
        "cfg": ctx.cfg,
        "recipe": ctx.recipe,
        "rank": rank,
        "world_size": world_size,
        "policy_dir": ctx.policy_dir,
        "banks": ctx.banks,
        "adapter_dir": ctx.adapter_dir,
        "policy_version": ctx.policy_version,
        "environment_urls": ctx.environment_urls,
    }


def _reference_arguments(ctx: WorkerContext, rank: int, world_size: int) -> dict:
    return {
        "cfg": ctx.cfg,
        "recipe": ctx.recipe,
        "rank": rank,
        "world_size": world_size,
        "reference_dir": ctx.reference_dir,
        "banks": ctx.banks,
    }


def _critic_arguments(ctx: WorkerContext, rank: int, world_size: int) -> dict:
    # The critic starts from the initial policy's body, whatever policy the actors resume from.
    return {
        "cfg": ctx.cfg,
        "recipe": ctx.recipe,
        "policy_dir": ctx.reference_dir,
        "banks": ctx.banks,
        "rank": rank,
        "world_size": world_size,
    }


def _advantage_arguments(ctx: WorkerContext, rank: int, world_size: int) -> dict:
    return {"cfg": ctx.cfg, "recipe": ctx.recipe, "banks": ctx.banks}


def _tokenizer_arguments(ctx: WorkerContext, rank: int, world_size: int) -> dict:
    return {"cfg": ctx.cfg, "recipe": ctx.recipe, "tokenizer_dir": ctx.reference_dir, "banks": ctx.banks}


# Each actor rank opens a device of its own (rldock.contract.placement) and holds the policy, its
# rollout engine (on each generation replica's first rank) and its optimizer. Its checkpoint: the policy
# (a resumed attempt's ranks load it as they start: WorkerContext.policy_dir), the optimizer, and each
# rank's torch RNG.
ACTOR = WorkerGroup(
    ACTOR_GROUP,
    "rldock.runtime.workers.actor:ActorWorker",
    _actor_arguments,
    ranks="actor_ranks",
    collective=True,
    memory="actor",
    checkpoint=CheckpointState(files=(POLICY_DIR, OPTIMIZER_FILE), rank_states="actors"),
)
# Its PP x DP x CP ranks form a group under CP or PP: each CP group attends as the actor's does, and the
# model is cut into the actor's stages.
REFERENCE = WorkerGroup(
    "reference",
    "rldock.runtime.workers.reference:ReferenceWorker",
    _reference_arguments,
    ranks="stage_sequence_ranks",
    collective_when_split=True,
)
# Its PP x DP x CP ranks: the actor's layout without TP, the value model cut into the actor's stages.
CRITIC = WorkerGroup(
    "critic",
    "rldock.runtime.workers.critic:CriticWorker",
    _critic_arguments,
    ranks="stage_sequence_ranks",
    collective=True,
    memory="critic",
    checkpoint=CheckpointState(files=(CRITIC_FILE, CRITIC_OPTIMIZER_FILE)),
)
REWARD = WorkerGroup("reward", "rldock.runtime.workers.reward:RewardWorker", _tokenizer_arguments, device=False)
ADVANTAGE = WorkerGroup(
    "advantage", "rldock.runtime.workers.advantage:AdvantageWorker", _advantage_arguments, device=False
)


# --- states --------------------------------------------------------------------------------------

ROLLOUT = WorkerState(
    "rollout",
    ACTOR,
    "generate",
    consumes=PROMPT,
    produces=RESPONSE + RESPONSE_LENGTH + POLICY_VERSION,
    runs_on="engines",
)
# Partial rollout's second round of a cut generation, launched by the run-ahead schedule after the
# update that cut it (rollout/partial.py); it writes into the rollout's columns, so the dock has no
# state of its own for it and no recipe lists it.
ROLLOUT_RESUME = WorkerState("rollout_resume", ACTOR, "finish_rollout", consumes=(), runs_on="engines")
ACTOR_INFERENCE = WorkerState(
    "actor_inference", ACTOR, "compute_old_logprobs", consumes=PROMPT + RESPONSE, produces=("old_logprobs",)
)
REFERENCE_INFERENCE = WorkerState(
    "reference", REFERENCE, "compute_ref_logprobs", consumes=PROMPT + RESPONSE, produces=("ref_logprobs",)
)
# `reward`: what the advantage reads (DAPO: shaped); `score`: the combined reward before shaping, what the
# driver reads (sample_facts: reward_mean) and DAPO's filter keeps groups by.
REWARD_STATE = WorkerState(
    "reward", REWARD, "compute_rewards", consumes=RESPONSE + PROMPT_ROW, produces=("reward", "score")
)
ADVANTAGE_STATE = WorkerState(
    "advantage", ADVANTAGE, "compute_advantages", consumes=("reward",), produces=("advantage",)
)
UPDATE = WorkerState(
    "update",
    ACTOR,
    "update",
    consumes=PROMPT + RESPONSE + ("old_logprobs", "ref_logprobs", "advantage") + POLICY_VERSION,
    trains=True,
)
# DPO trains in the actor's preference_update state on the DPO loss, not on a policy surrogate.
PREFERENCE_UPDATE = WorkerState(
    "preference_update", ACTOR, "preference_update", consumes=PROMPT + RESPONSE + ("ref_logprobs",), trains=True
)
# PPO's critic scores every response token before the advantage stage (GAE needs the values), and
# trains on the returns that stage writes.
CRITIC_INFERENCE = WorkerState(
    "critic_inference", CRITIC, "compute_values", consumes=PROMPT + RESPONSE, produces=("values",)
)
CRITIC_UPDATE = WorkerState(
    "critic_update", CRITIC, "update", consumes=PROMPT + RESPONSE + ("values", "returns"), trains=True
)
# The driver's read of each sample's facts (no worker runs it): the reward before shaping, the
# response's length and its prompt group's draw number (the prompt ledger's), read once the iteration's
# stages are done (driver/schedule/steps.py: read_facts), or each sampling round's by DAPO's filter
# (recipe.SamplingRounds.read_state). They stay in the dock and are read back from it, also by a resumed
# iteration; no stage returns them.
SAMPLE_FACTS = WorkerState("sample_facts", None, "", consumes=("score",) + RESPONSE_LENGTH + PROMPT_DRAW)

# The reward model (a `model` reward term; job_recipe adds it before the reward state, which reads
# its `rm_score` as that term's scores): one rank on a device share, like a reference rank.
REWARD_MODEL = WorkerState(
    "reward_model",
    WorkerGroup("reward_model", "rldock.runtime.workers.reward_model:RewardModelWorker", _tokenizer_arguments),
    method="compute_scores",
    consumes=PROMPT + RESPONSE,
    produces=RM_SCORE,
)


# --- reading the specs ---------------------------------------------------------------------------


def worker_groups(states: Sequence[WorkerState]) -> dict[str, WorkerGroup]:
    """Group name -> group of the workers `states` run on, in the states' order (the actor first
    where it runs one). Raises ValueError if two states name one group differently."""
    groups: dict[str, WorkerGroup] = {}
    for state in states:
        if state.group is None:
            continue
        known = groups.setdefault(state.group.name, state.group)
        if known != state.group:
            raise ValueError(
                f"state {state.name!r} names worker group {state.group.name!r} differently "
                f"from another state: {state.group} != {known}"
            )
    return groups


def states_layout(cfg: JobConfig, states: Sequence[WorkerState]) -> JobLayout:
    """The job's layout (rldock.contract.layout) seating the device workers of `states`: the actor
    ranks (DPO too trains on actor ranks) and every other device group their specs name."""
    others = (group for group in worker_groups(states).values() if group.device and group.name != ACTOR_GROUP)
    return job_layout(cfg, groups=[DeviceGroup(g.name, g.ranks, distinct=g.joins_group(cfg)) for g in others])


def placement_plan(
    cfg: JobConfig, states: Sequence[WorkerState], *, data_parallel_size: int | None = None
) -> PlacementPlan:
    """The placement plan (rldock.contract.placement) for the device workers of `states`, seated in
    the contract's SEAT_ORDER; `data_parallel_size` overrides the config's (the planner plans
    one DP rank)."""
    layout = states_layout(cfg, states)
    return (layout if data_parallel_size is None else layout.with_data_parallel_size(data_parallel_size)).plan


def runner_names(plan: PlacementPlan, state: WorkerState, *, generation_tp: int = 1) -> tuple[str, ...]:
    """The names (as PlacementPlan.workers_on gives them) of the device workers that run `state`:
    every rank of its group, or each generation replica's first actor rank; () where its workers
    hold no device or no worker runs it."""
    if state.group is None or state.runs_on == "pool":
        return ()
    names = tuple(f"{state.group.name} {rank}" for rank in range(len(plan.group(state.group.name))))
    return names[::generation_tp] if state.runs_on == "engines" else names


def memory_models(states: Sequence[WorkerState]) -> set[str]:
    """The planner's memory models the device workers of `states` need ("actor", "critic")."""
    return {group.memory for group in worker_groups(states).values() if group.memory is not None}
