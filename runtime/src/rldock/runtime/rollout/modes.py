"""Which rollout mode a job runs, chosen once from the config (the only place it is chosen), and the
mode built for one actor rank: `harness` for a job whose `agent` runs the user's harness
(agent.harness or agent.harness_command), `carry` for an `agent` job with rollout.partial_rollout carry,
`agent` for any other job with an `agent` section, `partial` for rollout.partial_rollout resume or drop,
`streamed` for rollout.stream_groups > 0, else `plain`. `counters_of` names the counters a mode reports
(`rollout/<key>` in each iteration's record).

The agent modes' modules are imported when a rank builds one: the harness mode's gateway brings FastAPI
and the others their environment clients, which no other job's processes use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rldock.config import JobConfig
from rldock.config.agent import partial_rollout_problem
from rldock.runtime.dock.stage_loop import StageSpec
from rldock.runtime.rollout import partial
from rldock.runtime.rollout.partial import PartialRollout
from rldock.runtime.rollout.plain import PlainRollout
from rldock.runtime.rollout.protocol import RolloutMode, rollout_setup
from rldock.runtime.rollout.streamed import StreamedRollout

MODES = ("plain", "streamed", "agent", "harness", "carry", "partial")


def mode_of(cfg: JobConfig) -> str:
    """The job's rollout mode. An agent's episodes are not streamed, and with partial rollout they are cut at
    a weight update and resumed, never dropped (rollout/agent.py, rollout/harness.py): the config's checks
    (rldock.config.agent, rldock.config.rollout) refuse the other combinations, which are asserted here.
    Partial rollout writes its uncut groups when the rank's batch has ended, so with it rollout.stream_groups
    is not read."""
    rollout = cfg.rollout
    if cfg.agent is not None:
        problem = partial_rollout_problem(cfg)
        assert problem is None, problem
        assert rollout.stream_groups == 0, "an agent's episodes are written when the rank's batch has ended"
        if cfg.agent.harnessed:
            return "harness"
        return "carry" if rollout.partial_rollout == "carry" else "agent"
    assert rollout.partial_rollout != "carry", "carried episodes are an agent's"
    if rollout.partial_rollout != "off":
        return "partial"
    if rollout.stream_groups > 0:
        return "streamed"
    return "plain"


def build_rollout(
    cfg: JobConfig,
    *,
    tokenizer,
    rank: int,
    batch_size: int,
    spec: StageSpec,
    environment_urls: Mapping[str, Sequence[str]] | None = None,
) -> RolloutMode:
    """The job's rollout mode for actor `rank`, reading the rollout state's columns (`spec`: the job
    recipe's rollout state) `batch_size` samples at a time. An agent's episodes check answers
    against each sample's train-file row (the dock's `prompt_row`) and run on the environment servers
    the trainer started (`environment_urls`)."""
    setup = rollout_setup(cfg, tokenizer=tokenizer, rank=rank, batch_size=batch_size, spec=spec)
    mode = mode_of(cfg)
    if mode in ("agent", "carry"):
        from rldock.runtime.rollout.agent import AgentRollout
        from rldock.runtime.rollout.agent_carry import CarriedAgentRollout
        from rldock.runtime.rollout.agent_episodes import AgentSampler

        sampler = AgentSampler(
            cfg,
            tokenizer=tokenizer,
            environment_urls=environment_urls or {},
            engine_columns=setup.engine_columns,
        )
        if mode == "agent":
            return AgentRollout(setup, sampler)
        return CarriedAgentRollout(
            setup,
            sampler,
            max_staleness=cfg.dock.max_staleness,
            iterations=cfg.iterations,
            replica=rank // cfg.rollout.tensor_parallel_size,
            seed=cfg.seed,
        )
    if mode == "harness":
        from rldock.runtime.rollout.harness import HarnessRollout

        return HarnessRollout(setup, cfg, tokenizer=tokenizer)
    if mode == "partial":
        return PartialRollout(setup, mode=cfg.rollout.partial_rollout)
    if mode == "streamed":
        return StreamedRollout(setup, stream_groups=cfg.rollout.stream_groups)
    return PlainRollout(setup)


def counters_of(cfg: JobConfig) -> tuple[str, ...]:
    """The counters the job's rollout mode reports in its results' metrics, each summed over ranks into
    `rollout/<key>` of the iteration's record (driver/records.py); none for the modes without."""
    mode = cfg.rollout.partial_rollout
    if mode == "carry":
        from rldock.runtime.rollout.agent_carry import METRIC_KEYS

        return METRIC_KEYS
    return partial.METRIC_KEYS if mode != "off" else ()
