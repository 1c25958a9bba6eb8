"""`training.pipeline_parallel_size: 2` in a real job: the demo config on two actor ranks, one pipeline stage
each (one decoder layer each; each rank its own vLLM replica, which gets the whole model gathered from both
stages after every update), and the reference on two ranks cut into the same stages (its KL term's logprobs
streamed through them, workers/reference.py). Two iterations and a checkpoint, resumed for a third: the
checkpoint is one process's (every weight in the Hugging Face layout, the optimizer state of both stages
under the whole model's names), and the resumed job's stages read their parts of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from jobs import train_demo  # tests/jobs.py

pytestmark = pytest.mark.integration


def run_job(output: Path, model: Path, *, iterations: int, resume: bool = False) -> list[dict]:
    overrides = {
        "iterations": iterations,
        "model.path": str(model),
        "warmup.steps": 0,
        "algorithm.num_prompts_per_iteration": 4,
        "algorithm.num_responses_per_prompt": 4,
        "training.data_parallel_size": 1,
        "training.pipeline_parallel_size": 2,
        "training.micro_batch_size": 4,  # 4 micro-batches a mini-batch of 16: the 1F1B schedule's steady state
        "training.strategy": "fsdp",
        "training.resharding": "allgather_swap",
        "rollout.cpu_kv_cache_gib": 0.25,
        "dock.timeout_s": 120,
        "checkpoint.interval": 2,
        "evaluation.interval": 0,
    }
    return train_demo(output, overrides, resume=resume)


def test_a_two_stage_job_trains_checkpoints_and_resumes(tmp_path):
    from safetensors.torch import load_file

    output, model = tmp_path / "run", tmp_path / "model"
    first = run_job(output, model, iterations=2)
    assert [r["iteration"] for r in first] == [1, 2]
    checkpoint = output / "checkpoints" / "iter-000002"
    weights = load_file(checkpoint / "policy" / "model.safetensors")
    layers = {name.split(".")[2] for name in weights if name.startswith("model.layers.")}
    assert layers == {"0", "1"} and "model.embed_tokens.weight" in weights and "model.norm.weight" in weights
    optimizer = torch.load(checkpoint / "optimizer.pt", map_location="cpu")
    assert set(optimizer["state"]) == {n for n in weights if n != "lm_head.weight"}  # a tied head counted once
    records = run_job(output, model, iterations=3, resume=True)
    assert [r["iteration"] for r in records] == [1, 2, 3] and records[:2] == first
    assert all(r["loss"] == r["loss"] and r["grad_norm"] > 0 for r in records)  # finite, and a step taken
