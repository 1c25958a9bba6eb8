"""Throughput with a heavy tail: carried episodes against synchronous iterations at one staleness bound.

Episodes of the tiny model (vLLM on the CPU, one engine for every episode) with an environment whose
every step, its reset included, sleeps `--step-seconds` x k, k drawn 1-10 per episode from its reset
seed: episodes last 1-10x each other. Each iteration writes a batch of `--groups` groups of `--responses`
episodes, then a stand-in for the weight update sleeps `--update-seconds` (the engine idle, the
environment's steps still running), then the version advances. Two runs of `--iterations` iterations on
the same engine, both with rollout/carry.py's CarriedEpisodes:
- `synchronous`: max_staleness 0, each iteration admits its groups and waits for all of them;
- `carried`: max_staleness `--max-staleness`: up to (bound + 1) batches of groups open, each batch the
  first groups to finish (a group due by the bound is waited for), the rest carried, sessions open,
  into the next iterations. No group is admitted past the run's total, so the last batches drain it.

Prints one JSON document: per run the wall time, samples (episodes written) per second, the episodes
started, written and dropped (started and neither written nor open at the end: must be 0), the staleness
histogram (versions between a group's admission and the batch that wrote it), the groups carried across
an update mid-episode (an episode's turns sampled by two versions) and each iteration's seconds; and
`samples_per_s_ratio`, carried over synchronous.

    .venv/bin/python -m rldock_benchmarks.heavy_tail > heavy-tail.json

The untrained tiny model never ends a turn with EOS, so its output layer is set to end about every other
token with one (`eos_heavy_model`): each turn is a few tokens and goes to the environment. What is
measured is the schedule, not learning: the update is a sleep and the weights stay the same from one
version to the next (each token still records the version it was sampled at).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import string
import sys
import time
from pathlib import Path
from typing import Any

from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, EpisodeContext, Observation
from rldock_benchmarks.smollm2_learning import log

MAX_MODEL_LEN = 64  # the tiny model's positions: prompt and every turn
MAX_RESPONSE = 40


class HeavyTailEnvironment(Environment):
    """Each episode's reset and every step sleep `step_seconds` x k, k drawn 1-10 from the reset seed;
    an episode is done after `steps` steps, rewarded 1."""

    def __init__(self, step_seconds: float, steps: int):
        self.step_seconds, self.steps = step_seconds, steps

    @classmethod
    def from_config(cls, agent, options) -> HeavyTailEnvironment:
        """In a job (agent.environment name `rldock_benchmarks.heavy_tail:HeavyTailEnvironment`): its options
        `step_seconds` and `steps`, given as strings."""
        return cls(float(options["step_seconds"]), int(options["steps"]))

    def session(self) -> EnvironmentSession:
        return HeavyTailSession(self)


class HeavyTailSession(EnvironmentSession):
    def __init__(self, environment: HeavyTailEnvironment):
        self.environment, self.taken = environment, 0

    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        self.seconds = self.environment.step_seconds * random.Random(seed).randint(1, 10)
        await asyncio.sleep(self.seconds)
        return Observation()

    async def step(self, text: str) -> Observation:
        await asyncio.sleep(self.seconds)
        self.taken += 1
        done = self.taken >= self.environment.steps
        return Observation(message=None if done else "go on", done=done, reward=1.0 if done else 0.0)


def eos_heavy_model(path: Path, *, max_model_len: int = MAX_MODEL_LEN) -> Path:
    """The tiny model at `path` (built once, `max_model_len` positions) with an output layer of its own
    (untied from the embedding) that reads one hidden dimension only: EOS's logit is that dimension x 4,
    every other token's 0, so EOS comes about every other token."""
    import torch
    from safetensors.torch import load_file, save_file

    from rldock.runtime.models.tiny import build_tiny_model

    if (path / "config.json").exists():
        return path
    build_tiny_model(path, texts=[string.printable], seed=0, max_position_embeddings=max_model_len)
    eos = json.loads((path / "tokenizer_config.json").read_text())["eos_token"]
    eos_id = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"][eos]
    weights_file = path / "model.safetensors"
    weights = load_file(weights_file)
    head = torch.zeros_like(weights["model.embed_tokens.weight"])  # (V, H)
    head[eos_id, 0] = 4.0
    norm = torch.zeros_like(weights["model.norm.weight"])  # (H,)
    norm[0] = 1.0
    weights.update({"lm_head.weight": head, "model.norm.weight": norm})
    save_file(weights, weights_file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))
    return path


def run(
    loop,
    prompts: list[list[int]],
    *,
    groups: int,
    responses: int,
    iterations: int,
    max_staleness: int,
    update_seconds: float,
    run_seed: int,
) -> dict[str, Any]:
    """`iterations` batches of `groups` groups through rollout/carry.py's CarriedEpisodes at `max_staleness`."""
    from rldock.runtime.rollout.carry import CarriedEpisodes

    carried = CarriedEpisodes(loop, num_groups=groups, max_staleness=max_staleness, seed=run_seed)
    total, admitted = groups * iterations, 0
    seconds: list[float] = []
    sessions_open_max = spanning = 0
    started = time.perf_counter()
    try:
        for version in range(iterations):
            began = time.perf_counter()
            count = min(carried.room, total - admitted)
            carried.admit(
                [prompts[(admitted + i) % len(prompts)] for i in range(count)],
                keys=[[(admitted + i) * responses + j for j in range(responses)] for i in range(count)],
                contexts=[EpisodeContext("", "heavy_tail", {})] * count,
                version=version,
            )
            admitted += count
            batch = carried.next_batch(version=version)
            spanning += sum(any(len(set(e.token_version) - {-1}) > 1 for e in g.episodes) for g in batch)
            sessions_open_max = max(sessions_open_max, loop.sessions_open_max)
            time.sleep(update_seconds)  # the weight update: the engine idles, the environment's steps go on
            seconds.append(time.perf_counter() - began)
        wall = time.perf_counter() - started
        open_at_end = sum(len(group.episodes) for group in carried.groups)
    finally:
        carried.abandon()
    counts = carried.counts
    return {
        "max_staleness": max_staleness,
        "wall_s": wall,
        "samples_per_s": counts.written / wall,
        "episodes": {
            "started": counts.started,
            "written": counts.written,
            "open_at_end": open_at_end,
            "dropped": counts.started - counts.written - open_at_end,
        },
        "staleness_histogram": {str(k): v for k, v in sorted(counts.staleness.items())},
        # groups with an episode whose turns two or more versions sampled: carried across an update mid-episode
        "groups_spanning_versions": spanning,
        "iteration_s": seconds,
        "iteration_s_median": statistics.median(seconds),
        "sessions_open_max": sessions_open_max,
    }


def heavy_tail_loop(model_dir: Path, *, step_seconds: float, steps: int, device: str = "cpu"):
    """The episode loop on the tiny model's engine (`eos_heavy_model` at `model_dir`) with the heavy-tailed
    environment, and 64 prompts for it."""
    from rldock.config.agent import AgentSpec
    from rldock.config.rollout import RolloutSpec
    from rldock.runtime.agent.episode_loop import AgentLoop
    from rldock.runtime.chat.conversation import ChatRenderer
    from rldock.runtime.chat.parsers import HermesParser
    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.models.loading import load_tokenizer

    model = eos_heavy_model(model_dir)
    tokenizer = load_tokenizer(str(model))
    engine = VllmRolloutEngine(
        model,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25),
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        device=detect_device(device),
    )
    renderer = ChatRenderer(tokenizer, tools=[], opens_with_environment=True)
    prompts = [
        tokenizer(renderer.prompt_text([{"role": "user", "content": f"q{i}"}]), add_special_tokens=False)["input_ids"]
        for i in range(64)
    ]
    loop = AgentLoop(
        engine=engine,
        tokenizer=tokenizer,
        renderer=renderer,
        tools={},
        environment=HeavyTailEnvironment(step_seconds, steps),
        parser=HermesParser(),
        spec=AgentSpec(max_turns=steps + 1),
        max_response_length=MAX_RESPONSE,
    )
    return loop, prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("runs/heavy-tail/model"))
    parser.add_argument("--groups", type=int, default=4, help="groups per batch (B)")
    parser.add_argument("--responses", type=int, default=2, help="episodes per group (N)")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--step-seconds", type=float, default=0.05, help="a step's sleep at k = 1")
    parser.add_argument("--steps", type=int, default=2, help="environment steps per episode after its reset")
    parser.add_argument("--update-seconds", type=float, default=0.2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the JSON report

    loop, prompts = heavy_tail_loop(args.model, step_seconds=args.step_seconds, steps=args.steps, device=args.device)
    shape = {
        "groups": args.groups,
        "responses": args.responses,
        "iterations": args.iterations,
        "update_seconds": args.update_seconds,
    }
    try:
        run(loop, prompts, **{**shape, "iterations": 1}, max_staleness=0, run_seed=99)  # vLLM's first steps
        report: dict[str, Any] = {}
        for name, bound in (("synchronous", 0), ("carried", args.max_staleness)):
            # the same seed: each episode draws the same slowness in both runs
            report[name] = run(loop, prompts, **shape, max_staleness=bound, run_seed=1)
            log(f"{name}: {report[name]['samples_per_s']:.2f} samples/s")
    finally:
        loop.close()
    result = {
        "shape": {
            **shape,
            "max_staleness": args.max_staleness,
            "step_seconds": args.step_seconds,
            "steps": args.steps,
            "slowness": "1-10x per episode",
        },
        **report,
        "samples_per_s_ratio": report["carried"]["samples_per_s"] / report["synchronous"]["samples_per_s"],
        "staleness_max": max(int(k) for k in report["carried"]["staleness_histogram"]),
        "episodes_dropped": sum(report[name]["episodes"]["dropped"] for name in ("synchronous", "carried")),
    }
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
