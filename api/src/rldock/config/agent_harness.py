"""`agent.harness_command_limits`: the resource limits every process of a harness command runs under
(rldock.runtime.gateway.harness_runner sets them before the command starts, so whatever it starts inherits
them); and the checks of `agent.harness_request` across sections (`problems`, called by agent.problems)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from rldock.config.problem import Problem
from rldock.config.section import Spec

if TYPE_CHECKING:
    from rldock.config.job import JobConfig


class HarnessCommandLimits(Spec):
    """Per-process limits (setrlimit) of `agent.harness_command` and every process it starts; its core dumps
    are always off (a core would hold the episode's key). A limit above the actor's own hard limit is
    lowered to it. Agent pods (`spec.agents`) are bounded by their pods' resources instead."""

    open_files: int = Field(
        default=1024,
        ge=16,
        le=1_048_576,
        description="Open files (RLIMIT_NOFILE) per process: sockets to the gateway and tools included.",
    )
    file_size_mib: int = Field(
        default=1024,
        ge=1,
        le=1_048_576,
        description="The largest file a process may write, in MiB (RLIMIT_FSIZE): a runaway log or tool output "
        "stops there instead of filling the actor's disk (the writer gets SIGXFSZ, which ends it; Python ignores "
        "it, and the write fails with EFBIG).",
    )
    memory_mib: int | None = Field(
        default=None,
        ge=64,
        le=1_048_576,
        description="Address space per process, in MiB (RLIMIT_AS); unset (the default): none. Address space is "
        "not memory in use: allocators and runtimes reserve far more than they touch (glibc's arenas, 64 MiB a "
        "thread; V8's heap cage), so set it well above what the agent uses, and test it.",
    )
    cpu_seconds: int | None = Field(
        default=None,
        ge=1,
        le=86_400,
        description="CPU seconds per process (RLIMIT_CPU: SIGXCPU, then SIGKILL); unset (the default): none, the "
        "episode's agent.episode_timeout_s bounds its wall time either way.",
    )


def problems(cfg: JobConfig) -> list[Problem]:
    """agent.harness_request renders a harness's prompts: it needs a harness, and its own system messages
    take data.system_prompt's place."""
    agent = cfg.agent
    if agent is None or agent.harness_request is None:
        return []
    if not agent.harnessed:
        return [
            Problem(
                "agent.harness_request",
                "set without a harness: it is the first request of your agent (agent.harness, "
                "agent.harness_command or agent.harness_pods), which rldock's own episode loop does not send; "
                "remove it",
            )
        ]
    if cfg.data.system_prompt is not None:
        return [
            Problem(
                "data.system_prompt",
                "set with agent.harness_request: the prompts' system messages are the harness's, as it sent "
                "them; remove data.system_prompt",
            )
        ]
    return []
