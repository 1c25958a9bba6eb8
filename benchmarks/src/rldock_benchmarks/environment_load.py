"""Load on environment services: does the engine keep generating while environment steps wait?

A job of the tiny model (warmed up on the addition answers, so every turn ends and goes to the
environment) runs through `rldock train` against `--replicas` local server processes of
SleepyEnvironment (`rldock env serve`), each holding `--sessions` sessions at once, where every step
sleeps `--step-seconds` and an episode is done after `--steps` steps. Per iteration the job's metrics
say how long the rollout engines generated while steps were out (`agent/engine_while_waiting_s`) and
how long they sat with nothing to generate (`agent/engine_blocked_s`); the environment's steps, their
wait (p50, p95) and the sessions left open after the rollout (`agent/environment/sessions_open`, which
must be 0) and open at most at once.

Prints one JSON document: per iteration those figures, the rollout's seconds, and two ratios against
the same run's numbers: `rollout_vs_serial` (rollout seconds / the steps' total sleep: below 1 when
steps overlap each other and generation), and `generation_share_while_waiting` (engine seconds while
steps were out / (that + blocked seconds)).

    .venv/bin/python -m rldock_benchmarks.environment_load --output runs/environment-load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, EpisodeContext, Observation
from rldock_benchmarks.smollm2_learning import log, read_records, train


class SleepyEnvironment(Environment):
    """An environment whose every step takes `step_seconds` of waiting (a remote call, a container) and
    whose episode is done after `steps` steps, rewarded 1."""

    def __init__(self, step_seconds: str = "1", steps: str = "2"):
        self.step_seconds, self.steps = float(step_seconds), int(steps)

    def session(self) -> EnvironmentSession:
        return SleepySession(self.step_seconds, self.steps)


class SleepySession(EnvironmentSession):
    def __init__(self, step_seconds: float, steps: int):
        self.step_seconds, self.steps, self.taken = step_seconds, steps, 0

    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        return Observation()

    async def step(self, text: str) -> Observation:
        await asyncio.sleep(self.step_seconds)
        self.taken += 1
        done = self.taken >= self.steps
        return Observation(message=None if done else "go on", reward=1.0 if done else 0.0, done=done)


def job_config(args: argparse.Namespace, output: Path) -> dict[str, Any]:
    command = [
        str(Path(sys.executable).with_name("rldock")),
        "env",
        "serve",
        "rldock_benchmarks.environment_load:SleepyEnvironment",
        "--port",
        "{port}",
        "--sessions",
        str(args.sessions),
        "--option",
        f"step_seconds={args.step_seconds}",
        "--option",
        f"steps={args.steps}",
    ]
    return {
        "name": "environment-load",
        "seed": 0,
        "iterations": args.iterations,
        "model": {"path": str(output / "model"), "builder": "tiny-qwen2"},
        "data": {"generator": {"name": "addition", "max_operand": 9, "num_prompts": 256}, "chat_template": "model"},
        "warmup": {"steps": 150, "batch_size": 32, "learning_rate": 0.003},
        "reward": {"terms": [{"name": "environment"}]},
        "agent": {
            "environment": {
                "name": "openenv",
                "servers": {"command": command, "replicas": args.replicas, "sessions_per_replica": args.sessions},
            },
            "max_turns": args.steps + 1,
            "max_tool_response_tokens": 8,
        },
        "algorithm": {
            "name": "grpo",
            "num_prompts_per_iteration": args.prompts,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 48,
            "max_response_length": 96,
            "learning_rate": 1e-4,
        },
        "training": {"data_parallel_size": 1, "micro_batch_size": 16},
        "dock": {"timeout_s": 600},
        "checkpoint": {"interval": args.iterations},
    }


def iteration_figures(record: dict[str, Any], step_seconds: float) -> dict[str, Any]:
    agent = record["agent"]
    steps = agent["environment/steps"]
    rollout = record["timing"]["rollout"]
    overlap, blocked = agent["engine_while_waiting_s"], agent["engine_blocked_s"]
    return {
        "iteration": record["iteration"],
        "episodes": round(agent["environment/resets"]),
        "steps": round(steps),
        "step_p50_s": agent.get("environment/step_p50_s"),
        "step_p95_s": agent.get("environment/step_p95_s"),
        "errors": agent["environment/errors"],
        "sessions_open_after": agent["environment/sessions_open"],
        "sessions_open_max": agent["environment/sessions_open_max"],
        "rollout_s": rollout,
        "engine_while_waiting_s": overlap,
        "engine_blocked_s": blocked,
        "rollout_vs_serial": rollout / (steps * step_seconds) if steps else None,
        "generation_share_while_waiting": overlap / (overlap + blocked) if overlap + blocked else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/environment-load"))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=4, help="sessions per replica")
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=2, help="steps per episode")
    parser.add_argument("--prompts", type=int, default=8, help="G; 4 responses each")
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    args.output.mkdir(parents=True, exist_ok=True)
    config = args.output / "job.yaml"
    config.write_text(yaml.safe_dump(job_config(args, args.output)))
    seconds = train(config, args.output / "run", [], label="environment-load")
    records = [r for r in read_records(args.output / "run") if "timing" in r]
    figures = [iteration_figures(record, args.step_seconds) for record in records]
    log(f"environment-load: {len(figures)} iterations in {seconds:.0f} s")
    print(
        json.dumps(
            {
                "benchmark": "environment_load",
                "replicas": args.replicas,
                "sessions_per_replica": args.sessions,
                "step_seconds": args.step_seconds,
                "steps_per_episode": args.steps,
                "episodes_per_iteration": args.prompts * 4,
                "iterations": figures,
                "job_seconds": seconds,
                "seconds": time.perf_counter() - started,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
