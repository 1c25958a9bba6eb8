"""The rollout's agent metrics: sums per engine (they merge by adding, across ranks and DAPO's rounds),
then one record section per iteration.

In metrics.jsonl and TensorBoard under `agent/`: `turns_mean` (model turns per episode),
`tool_calls_mean` and `tool_errors_mean` (per episode), per tool `calls/<tool>`, `errors/<tool>` and
`latency_s/<tool>` (mean seconds per call), `model_token_share` (of the response tokens, the share the
model sampled: what trains), and `ended/<reason>` (episodes that ended at an answer, at max_turns or
at the length budget), and the tools' own counters (ToolResult.counts: the python tool's
`sandbox/without_<layer>`, calls run without a kernel layer, and `sandbox/<outcome>`, calls the sandbox
stopped: cpu_limit, memory_limit, wall_limit, disk_limit, refused, hook_failed). Calls that named no tool count under
`malformed` and `unknown`. `engine_while_waiting_s` and `engine_blocked_s`: seconds the engines generated
while tool calls or environment steps were out, and sat with nothing to generate until one answered.
With an environment, under `agent/environment/`: `resets`, `steps`, `errors` (sessions that failed,
broke the protocol, timed out or found no replica), `step_p50_s` and `step_p95_s` (seconds a reset
or a step waited), `sessions_open` (left open after the rollout: 0 unless a close failed) and
`sessions_open_max` (the most at once), and `reward/turn_<k>` (the mean reward of the k-th step, over the
episodes that took it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

from rldock.runtime.agent.episode_loop import MALFORMED, UNKNOWN, AgentLoop, Episode

# Per-episode ends of an environment's session that are its failures (not the model's).
SESSION_FAILURES = (
    "environment_error",
    "environment_protocol_error",
    "environment_timeout",
    "environment_unavailable",
)
Sums = dict[str, float | list[float]]  # additive figures; a list (wait times) adds by concatenation


def episode_sums(episodes: Sequence[Episode], loop: AgentLoop | None = None) -> Sums:
    """Additive figures of one engine's episodes (`loop`: the sessions it has open)."""
    sums: defaultdict[str, float] = defaultdict(float)
    sums.update(
        episodes=len(episodes),
        turns=sum(e.turns for e in episodes),
        model_tokens=sum(sum(e.model_mask) for e in episodes),
        response_tokens=sum(len(e.response) for e in episodes),
    )
    for episode in episodes:
        sums[f"ended/{episode.ended}"] += 1
        for name, count in episode.tool_calls.items():
            sums[f"calls/{name}"] += count
            sums[f"errors/{name}"] += episode.tool_errors[name]
            sums[f"seconds/{name}"] += episode.tool_seconds.get(name, 0.0)
        for key, count in episode.tool_counts.items():
            sums[f"counts/{key}"] += count
        for turn, reward in enumerate(episode.rewards, start=1):
            sums[f"environment/reward_sum/turn_{turn}"] += reward
            sums[f"environment/reward_count/turn_{turn}"] += 1
    result: Sums = dict(sums)
    waits = [seconds for episode in episodes for seconds in episode.step_seconds]
    if loop is not None:  # seconds the engine generated while calls or steps were out, and sat blocked on them
        result["engine_while_waiting_s"] = loop.timing.engine_while_waiting_s
        result["engine_blocked_s"] = loop.timing.blocked_s
    if loop is not None and loop.environment is not None:
        result.update(
            {
                "environment/resets": float(sum(1 for e in episodes if e.step_seconds)),
                "environment/steps": float(sum(len(e.rewards) for e in episodes)),
                "environment/errors": float(sum(1 for e in episodes if e.ended in SESSION_FAILURES)),
                "environment/sessions_open": float(loop.sessions_open),
                "environment/sessions_open_max": float(loop.sessions_open_max),
                "environment/wait_s": waits,
            }
        )
    return result


def merged_sums(parts: Sequence[Sums]) -> Sums:
    """Several `episode_sums` as one (an engine's batches, or several engines)."""
    total: dict[str, float | list[float]] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                total[key] = [*total.get(key, []), *value]  # type: ignore[misc]
            else:
                total[key] = total.get(key, 0.0) + value  # type: ignore[operator]
    return total


def agent_metrics(sums: Sequence[Sums]) -> dict[str, dict[str, float]]:
    """The iteration's `agent` section from every engine's `episode_sums`; empty without any."""
    merged = merged_sums(sums)
    waits = merged.pop("environment/wait_s", None)
    total: defaultdict[str, float] = defaultdict(float, merged)  # type: ignore[arg-type]
    if not total["episodes"]:
        return {}
    episodes = total["episodes"]
    tools = sorted(key.removeprefix("calls/") for key in total if key.startswith("calls/"))
    calls = sum(total[f"calls/{name}"] for name in tools)
    errors = sum(total[f"errors/{name}"] for name in tools)
    section: dict[str, float] = {
        "turns_mean": total["turns"] / episodes,
        "tool_calls_mean": calls / episodes,
        "tool_errors_mean": errors / episodes,
        "model_token_share": total["model_tokens"] / max(total["response_tokens"], 1),
    }
    for name in tools:
        section[f"calls/{name}"] = total[f"calls/{name}"]
        section[f"errors/{name}"] = total[f"errors/{name}"]
        if name not in (MALFORMED, UNKNOWN):  # calls that reached no tool took no time
            section[f"latency_s/{name}"] = total[f"seconds/{name}"] / max(total[f"calls/{name}"], 1)
    section.update({key: total[key] for key in sorted(total) if key.startswith("ended/")})
    section.update({key: total[key] for key in ("engine_while_waiting_s", "engine_blocked_s") if key in total})
    section.update({key.removeprefix("counts/"): total[key] for key in sorted(total) if key.startswith("counts/")})
    if waits is not None:  # a job with an environment
        for name in ("resets", "steps", "errors", "sessions_open", "sessions_open_max"):
            section[f"environment/{name}"] = total[f"environment/{name}"]
        if waits:
            section["environment/step_p50_s"] = float(np.percentile(waits, 50))
            section["environment/step_p95_s"] = float(np.percentile(waits, 95))
    for key in sorted(total):
        if key.startswith("environment/reward_sum/"):
            turn = key.removeprefix("environment/reward_sum/")
            section[f"environment/reward/{turn}"] = total[key] / total[f"environment/reward_count/{turn}"]
    return {"agent": section}
