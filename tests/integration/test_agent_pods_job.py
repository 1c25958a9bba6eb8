"""Agent pods' episodes in a real job: `rldock train` on CPU with `agent.harness_pods` (what the operator sets
for spec.agents), its actor serving the gateway and dispatcher on the contract's port over the real vLLM
engine, and two runners (rldock.contract.agent_runner, as the pods run it) in local processes standing in
for the pods, each running the user's OpenAI-client command per episode. After the first iteration one
runner is killed with its command (a pod lost); the job goes on with the other and every episode is
served, its dock row exactly the ids the engine sampled.

Not here: Kubernetes (tests/integration/test_operator_agents.py runs the pods' objects on the control plane
with the gateway over the engine double); the runners reach the actor at 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jobs  # tests/jobs.py
import pytest

import rldock.contract.agent_runner as agent_runner
from rldock.contract.agent_pods import GATEWAY_ENV, GATEWAY_PORT
from rldock.contract.runtime_cli import ENVIRONMENT_TOKEN_ENV

pytestmark = pytest.mark.integration

ITERATIONS = 2
EPISODES = 8  # per iteration: 4 prompts x 2 responses
TOKEN = "agent-pods-test-token"
AGENT = """
import json, os, openai
task = json.loads(os.environ["RLDOCK_TASK"])
prompt = task["prompt"]
messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
client = openai.OpenAI()
answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
text = (answer.choices[0].message.content or "").strip()
digits = [a == b for a, b in zip(text, task["ground_truth"])]
print(json.dumps({"reward": sum(digits) / max(len(task["ground_truth"]), len(text), 1)}))
"""


def _config(root: Path) -> dict:
    return {
        "name": "it-agent-pods",
        "seed": 1,
        "iterations": ITERATIONS,
        "model": {"path": str(root / "model"), "builder": "tiny-qwen2"},
        "data": {"generator": {"name": "addition", "max_operand": 99, "num_prompts": 200}, "chat_template": "model"},
        "reward": {"terms": [{"name": "environment"}]},
        "agent": {"harness_pods": True, "episode_timeout_s": 300},
        "algorithm": {
            "name": "grpo",
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 48,
            "max_response_length": 64,
            "learning_rate": 1e-4,
        },
        "training": {"data_parallel_size": 1, "micro_batch_size": 8},
        "dock": {"timeout_s": 300},
        "checkpoint": {"interval": ITERATIONS},
    }


def _runner(script: Path) -> subprocess.Popen:
    env = {**os.environ, GATEWAY_ENV: f"127.0.0.1:{GATEWAY_PORT}", ENVIRONMENT_TOKEN_ENV: TOKEN}
    argv = [sys.executable, agent_runner.__file__, "--episodes", "4", "--", sys.executable, str(script)]
    return subprocess.Popen(argv, env=env, start_new_session=True)


def test_agent_pods_serve_a_real_job_and_one_lost_leaves_it_running(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    metrics = tmp_path / "run" / "metrics.jsonl"
    runners = [_runner(tmp_path / "agent.py"), _runner(tmp_path / "agent.py")]
    # The job's log goes to a file: a pipe nobody reads while the test polls would fill and stall it.
    log = tmp_path / "train.log"
    log_file = log.open("w")
    job = jobs.start(
        _config(tmp_path),
        tmp_path / "run",
        max_restarts=None,
        progress=True,
        env={**os.environ, ENVIRONMENT_TOKEN_ENV: TOKEN},
        log=log_file,
    )
    try:
        deadline = time.monotonic() + 1200
        while job.poll() is None and not (metrics.exists() and metrics.read_text().strip()):
            assert time.monotonic() < deadline, "no first iteration in 20 minutes"
            time.sleep(1)
        os.killpg(runners[0].pid, signal.SIGKILL)  # a pod lost: its runner and what it runs
        job.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for runner in runners:
            if runner.poll() is None:
                os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()
        if job.poll() is None:
            job.kill()
        log_file.close()
    assert job.returncode == 0, log.read_text()[-4000:]
    records = jobs.records(tmp_path / "run")
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    for record in records:
        agent = record["agent"]
        served = agent.get("ended/harness_done", 0)
        lost = agent.get("ended/harness_lost", 0)
        assert served + lost == EPISODES and served >= EPISODES // 2, agent
        assert agent["gateway/exact_episodes"] == EPISODES, agent
