"""The rollout's agent metrics: sums per engine (they merge by adding, across ranks and DAPO's rounds),
then one record section per iteration.

In metrics.jsonl and TensorBoard under `agent/`: `turns_mean` (model turns per episode),
`tool_calls_mean` and `tool_errors_mean` (per episode), per tool `calls/<tool>`, `errors/<tool>` and
`latency_s/<tool>` (mean seconds per call), `model_token_share` (of the response tokens, the share the
model sampled: what trains), and `ended/<reason>` (episodes that ended at an answer, at max_turns or
at the length budget), and the tools' own counters (ToolResult.counts: the python tool's
`sandbox/without_<layer>`, calls run without a kernel layer). Calls that named no tool count under
`malformed` and `unknown`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from rldock.runtime.agent.rollout import MALFORMED, UNKNOWN, Episode


def episode_sums(episodes: Sequence[Episode]) -> dict[str, float]:
    """Additive figures of one engine's episodes."""
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
    return dict(sums)


def merged_sums(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Several `episode_sums` as one (an engine's batches, or several engines)."""
    total: defaultdict[str, float] = defaultdict(float)
    for part in parts:
        for key, value in part.items():
            total[key] += value
    return dict(total)


def agent_metrics(sums: Sequence[dict[str, float]]) -> dict[str, dict[str, float]]:
    """The iteration's `agent` section from every engine's `episode_sums`; empty without any."""
    total = defaultdict(float, merged_sums(sums))
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
    section.update({key.removeprefix("counts/"): total[key] for key in sorted(total) if key.startswith("counts/")})
    return {"agent": section}
