"""The rollout a job runs, chosen once from the config on two axes (the only place either is read for it):

- the episode **source**, where a batch's responses come from: `engine` (one engine call per batch of whole
  prompt groups; rollout.stream_groups > 0 writes its groups as they finish), `agent` (the native agent loop,
  a job with an `agent` section) or `harness` (a user's harness through the gateway: agent.harness,
  agent.harness_command or agent.harness_pods);
- the round **policy**, what a weight update that cuts the generation does to it (rollout.partial_rollout):
  `complete` (`off`: nothing is cut), `resume` (cut at the token budget and continued on the new weights),
  `drop` (sampled again on them) or `carry` (an agent's episode groups kept open across iterations within
  dock.max_staleness).

`ROLLOUTS` names the rollout of each pair that is built; the config's checks refuse the others, each with its
reason (rldock.config.agent's `partial_rollout_problem`: `drop` with an agent or a harness, `carry` with a
harness; rldock.config.rollout: `carry` without an agent; docs/agentic.md), which `rollout_pair` asserts.
`counters_of` names the counters a policy reports (`rollout/<key>` in each iteration's record).

The agent sources' modules are imported when a rank builds one: the harness's gateway brings FastAPI and the
native loop its environment clients, which no other job's processes use."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rldock.config import JobConfig
from rldock.config.agent import partial_rollout_problem
from rldock.runtime.dock.stage_loop import StageSpec
from rldock.runtime.rollout import partial
from rldock.runtime.rollout.partial import PartialRollout
from rldock.runtime.rollout.plain import PlainRollout
from rldock.runtime.rollout.protocol import RolloutMode, RolloutSetup, rollout_setup
from rldock.runtime.rollout.streamed import StreamedRollout

if TYPE_CHECKING:
    from rldock.runtime.rollout.agent_episodes import AgentSampler

SOURCES = ("engine", "agent", "harness")
POLICIES = ("complete", "resume", "drop", "carry")


@dataclass(frozen=True)
class RankInputs:
    """What a rank's rollout is built from besides its setup: the job's config, its tokenizer, the rank, and the
    environment servers the trainer started (`environment_urls`: config field -> base URLs)."""

    cfg: JobConfig
    tokenizer: Any  # a Hugging Face tokenizer
    rank: int
    environment_urls: Mapping[str, Sequence[str]]


def _engine_complete(setup: RolloutSetup, inputs: RankInputs) -> RolloutMode:
    stream_groups = inputs.cfg.rollout.stream_groups  # how its writes are cut, not where its responses come from
    return StreamedRollout(setup, stream_groups=stream_groups) if stream_groups > 0 else PlainRollout(setup)


def _engine_partial(setup: RolloutSetup, inputs: RankInputs) -> RolloutMode:
    # its uncut groups are written when the rank's batch has ended: rollout.stream_groups is not read
    return PartialRollout(setup, policy=partial.CUT_POLICIES[inputs.cfg.rollout.partial_rollout])


def _agent_sampler(setup: RolloutSetup, inputs: RankInputs) -> AgentSampler:
    from rldock.runtime.rollout.agent_episodes import AgentSampler

    return AgentSampler(
        inputs.cfg,
        tokenizer=inputs.tokenizer,
        environment_urls=inputs.environment_urls,
        engine_columns=setup.engine_columns,
    )


def _agent(setup: RolloutSetup, inputs: RankInputs) -> RolloutMode:
    from rldock.runtime.rollout.agent import AgentRollout

    return AgentRollout(setup, _agent_sampler(setup, inputs))


def _agent_carry(setup: RolloutSetup, inputs: RankInputs) -> RolloutMode:
    from rldock.runtime.rollout.agent_carry import CarriedAgentRollout

    cfg = inputs.cfg
    return CarriedAgentRollout(
        setup,
        _agent_sampler(setup, inputs),
        max_staleness=cfg.dock.max_staleness,
        iterations=cfg.iterations,
        replica=inputs.rank // cfg.rollout.tensor_parallel_size,
        seed=cfg.seed,
    )


def _harness(setup: RolloutSetup, inputs: RankInputs) -> RolloutMode:
    from rldock.runtime.rollout.harness import HarnessRollout

    return HarnessRollout(setup, inputs.cfg, tokenizer=inputs.tokenizer)


# (source, policy) -> its rollout's builder. The episode sources share the round policies' code: `complete` and
# `resume` are one class each for the agent and the harness (rollout/episode_rounds.py: a round with no token
# budget runs its episodes to their ends).
ROLLOUTS: dict[tuple[str, str], Callable[[RolloutSetup, RankInputs], RolloutMode]] = {
    ("engine", "complete"): _engine_complete,
    ("engine", "resume"): _engine_partial,
    ("engine", "drop"): _engine_partial,
    ("agent", "complete"): _agent,
    ("agent", "resume"): _agent,
    ("agent", "carry"): _agent_carry,
    ("harness", "complete"): _harness,
    ("harness", "resume"): _harness,
}


def rollout_pair(cfg: JobConfig) -> tuple[str, str]:
    """The job's (source, policy) (module docstring); a pair the config's checks refuse is asserted out."""
    agent = cfg.agent
    source = "engine" if agent is None else "harness" if agent.harnessed else "agent"
    policy = "complete" if cfg.rollout.partial_rollout == "off" else cfg.rollout.partial_rollout
    problem = partial_rollout_problem(cfg)
    assert problem is None, problem
    assert agent is None or cfg.rollout.stream_groups == 0, "an agent's episodes are written when the batch has ended"
    assert (source, policy) in ROLLOUTS, f"rollout.partial_rollout {policy!r} with the {source} source is refused"
    return source, policy


def build_rollout(
    cfg: JobConfig,
    *,
    tokenizer,
    rank: int,
    batch_size: int,
    spec: StageSpec,
    environment_urls: Mapping[str, Sequence[str]] | None = None,
) -> RolloutMode:
    """The job's rollout for actor `rank`, reading the rollout state's columns (`spec`: the job recipe's rollout
    state) `batch_size` samples at a time. An agent's episodes check answers against each sample's train-file
    row (the dock's `prompt_row`) and run on the environment servers the trainer started (`environment_urls`)."""
    setup = rollout_setup(cfg, tokenizer=tokenizer, rank=rank, batch_size=batch_size, spec=spec)
    inputs = RankInputs(cfg, tokenizer, rank, environment_urls or {})
    return ROLLOUTS[rollout_pair(cfg)](setup, inputs)


def _carry_counters() -> tuple[str, ...]:
    from rldock.runtime.rollout.agent_carry import METRIC_KEYS

    return METRIC_KEYS


# policy -> the counters it reports (the carry policy's module is imported when a job carries)
POLICY_COUNTERS: dict[str, Callable[[], tuple[str, ...]]] = {
    "complete": tuple,
    "resume": lambda: partial.METRIC_KEYS,
    "drop": lambda: partial.METRIC_KEYS,
    "carry": _carry_counters,
}


def counters_of(cfg: JobConfig) -> tuple[str, ...]:
    """The counters the job's round policy reports in its results' metrics, each summed over ranks into
    `rollout/<key>` of the iteration's record (driver/records.py); none for `complete`."""
    return POLICY_COUNTERS[rollout_pair(cfg)[1]]()
