"""A harness of the user's (a plain loop over `openai.AsyncOpenAI`, two turns per episode) trains the tiny
model through `rldock train` on CPU, served by the real vLLM engine behind the gateway; every episode's
dock row is exactly the ids the engine sampled (the engine's own record, `agent/gateway/exact_episodes`);
held-out evaluation runs the same harness, greedily, on the held-out prompts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.integration

ITERATIONS = 2
HELD_OUT = 8
HARNESS = """
async def run(task, client):
    prompt = task["prompt"]
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
    messages = [*messages, first.choices[0].message.model_dump(exclude_none=True)]
    messages.append({"role": "user", "content": "Check it and give the number only."})
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
    answer = (second.choices[0].message.content or "").strip()
    digits = [a == b for a, b in zip(answer, task["ground_truth"])]
    return {"reward": sum(digits) / max(len(task["ground_truth"]), len(answer), 1)}
"""


def _config(root: Path) -> dict:
    return {
        "name": "it-harness",
        "seed": 1,
        "iterations": ITERATIONS,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "data": {
            "generator": {"name": "addition", "max_operand": 99, "num_prompts": 200, "num_val_prompts": HELD_OUT},
            "chat_template": "model",
        },
        "reward": {"terms": [{"name": "environment"}]},
        "agent": {"harness": f"{root / 'harness.py'}:run", "episode_timeout_s": 300},
        "algorithm": {
            "name": "grpo",
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 48,
            "max_response_length": 96,
            "learning_rate": 1e-4,
        },
        "training": {"data_parallel_size": 1, "micro_batch_size": 16},
        "dock": {"timeout_s": 300},
        "checkpoint": {"interval": ITERATIONS},
        "evaluation": {"interval": ITERATIONS},
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("harness")
    (root / "harness.py").write_text(HARNESS)
    (root / "job.yaml").write_text(yaml.safe_dump(_config(root)))
    done = subprocess.run(
        [sys.executable, "-m", "rldock.runtime.cli", "train", str(root / "job.yaml"), "--output", str(root / "run")],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return root / "run"


def records_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_plain_openai_harness_trains_token_exact(run):
    records = [r for r in records_of(run) if r["iteration"] > 0]  # iteration 0: the initial policy's evaluation
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    for record in records:
        agent = record["agent"]
        assert agent["ended/harness_done"] == 16, agent
        assert agent["gateway/exact_episodes"] == 16 and agent.get("gateway/inexact_episodes", 0) == 0, agent
        assert agent["turns_mean"] == 2.0, agent
        assert 0.0 < agent["model_token_share"] < 1.0  # the second user turn is context, not trained


def test_held_out_evaluation_runs_the_harness(run):
    # before any rollout (iteration 0) and after the last update
    evaluated = [r for r in records_of(run) if "val/accuracy" in r]
    assert [r["iteration"] for r in evaluated] == [0, ITERATIONS]
    for record in evaluated:  # every held-out episode was the harness's, two turns each, exact
        assert record["val/agent/ended/harness_done"] == HELD_OUT, record
        assert record["val/agent/turns_mean"] == 2.0
        assert record["val/agent/gateway/exact_episodes"] == HELD_OUT
        assert 0.0 <= record["val/reward"] <= 1.0
