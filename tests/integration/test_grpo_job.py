"""A real GRPO job end to end: local Ray, vLLM rollout, DDP update, every sample through the dock.

One job is killed with SIGKILL mid-run and resumed, so the same run checks the outputs, the dock's
accounting and resume without lost or repeated iterations.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time
from pathlib import Path

import jobs  # tests/jobs.py
import pytest
import yaml

from rldock.contract.progress import last_progress

pytestmark = pytest.mark.integration

G, N, ITERATIONS = 4, 4, 4


def job_config(model_dir: Path, iterations: int = ITERATIONS) -> dict:
    return {
        "name": "it-grpo",
        "seed": 1,
        "iterations": iterations,
        "model": {"path": str(model_dir), "builder": "tiny-qwen2"},
        "warmup": {"steps": 20, "batch_size": 32},
        "algorithm": {
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 1e-4,
        },
        "training": {"data_parallel_size": 2, "micro_batch_size": 8},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 2, "keep_last": 2},
    }


def wait_for_output(job, text: str, *, timeout_s: float) -> str:
    """Read the job's output until it holds `text`; what was read (the job keeps running). From the
    pipe's descriptor, not its buffered text reader, which could hold the line back while the job,
    waiting, prints nothing more."""
    read, deadline = b"", time.monotonic() + timeout_s
    while text.encode() not in read:
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s:\n{read[-4000:].decode(errors='replace')}"
        ready, _, _ = select.select([job.stdout], [], [], 1.0)
        if ready:
            chunk = os.read(job.stdout.fileno(), 65536)
            assert chunk, f"the job ended before {text!r}:\n{read[-4000:].decode(errors='replace')}"
            read += chunk
    return read.decode(errors="replace")


def read_metrics(output: Path) -> list[dict]:
    path = output / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def interrupted_then_resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    config = root / "job.yaml"
    config.write_text(yaml.safe_dump(job_config(root / "model")))
    output = root / "run"

    job = jobs.start(
        config,
        output,
        max_restarts=None,
    )
    deadline = time.monotonic() + 600
    # Kill after iteration 3 is logged: the last checkpoint is at 2, so 3 must be redone once.
    while len(read_metrics(output)) < 3:
        assert job.poll() is None, f"job exited early:\n{job.stdout.read()}"
        assert time.monotonic() < deadline, "job made no progress in 10 minutes"
        # Poll fast: an iteration takes a few hundred ms, so the kill lands inside iteration 4
        # (before its checkpoint); a slow poll let iteration 4 finish first on a quiet machine.
        time.sleep(0.02)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    killed_at = len(read_metrics(output))

    resumed = jobs.start(
        config,
        output,
        resume=True,
        max_restarts=None,
    )
    log, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, log
    return output, killed_at, log


def test_resume_after_sigkill_neither_loses_nor_repeats_iterations(interrupted_then_resumed):
    output, killed_at, log = interrupted_then_resumed
    assert killed_at >= 3
    records = read_metrics(output)
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    assert "resuming after iteration 2" in log
    progress = last_progress(log.splitlines())
    assert progress["iteration"] == ITERATIONS and progress["checkpoint"] == ITERATIONS
    summaries = [json.loads(line) for line in log.splitlines() if line.startswith('{"iterations"')]
    assert summaries and summaries[-1]["iterations"] == ITERATIONS


def test_metrics_have_the_documented_fields(interrupted_then_resumed):
    output, _, _ = interrupted_then_resumed
    for record in read_metrics(output):
        for key in ("reward_mean", "reward_std", "response_length_mean", "kl", "loss", "tokens_per_s_per_device"):
            assert isinstance(record[key], float), key
        assert 0.0 <= record["reward_mean"] <= 1.0
        assert record["tokens_per_s_per_device"] > 0
        for stage in (
            "rollout",
            "reference",
            "reward",
            "update",
            "dispatch",
            "iteration",
            "idle/rollout",
            "idle/update",
        ):
            assert record["timing"][stage] >= 0, stage
        for stage in ("rollout", "reference", "reward", "update"):  # compute is part of the busy time
            assert 0 <= record["timing"][f"compute/{stage}"] <= record["timing"][stage], stage
        # The advantage is fused into the reward state: the reward worker writes the advantages.
        assert "advantage" not in record["timing"]
        # One update per iteration (recompute_old_logprobs: auto): the update's own pass gives the old logprobs.
        assert "actor_inference" not in record["timing"] and record["clip_fraction"] == 0.0


def test_the_job_reads_the_seeded_peak_and_measures_nothing(interrupted_then_resumed, seeded_peak_cache):
    """The `rldock train` subprocess and its Ray workers inherit the test session's peak cache
    (tests/conftest.py): each stage's MFU is over the seeded figure, and no measurement was added."""
    output, _, _ = interrupted_then_resumed
    (seeded,) = (json.loads(path.read_text()) for path in seeded_peak_cache.glob("cpu-float32-*.json"))
    assert len(list(seeded_peak_cache.glob("*.json"))) == 3  # the seeded dtypes only
    for record in read_metrics(output):
        for stage in ("rollout", "reference", "update"):
            expected = record[f"flops/{stage}"] / record["timing"][f"compute/{stage}"] / seeded["peak_flops"]
            assert record[f"mfu/{stage}"] == pytest.approx(expected), stage


def test_flops_agree_with_a_hand_count(interrupted_then_resumed):
    """Each stage's recorded FLOPs against rldock_benchmarks.flop_count's hand count (the model's
    safetensors, metrics.jsonl's mean lengths): within 10%, between each prompt computed once and
    once per rank where a group's responses may sit on both ranks."""
    from rldock_benchmarks.flop_count import compare

    output, _, _ = interrupted_then_resumed
    rows = compare(output)
    assert {row["stage"] for row in rows} == {"rollout", "reference", "update"}
    assert len(rows) == 3 * ITERATIONS
    for row in rows:
        assert 0.9 * row["hand"] <= row["reported"] <= 1.1 * row.get("hand_split", row["hand"]), row
        assert row["mfu"] > 0, row


def test_every_sample_went_through_the_dock(interrupted_then_resumed):
    output, _, _ = interrupted_then_resumed
    dock = read_metrics(output)[-1]["dock"]
    # Each worker state took every sample of the iteration exactly once from its controller.
    for state, counters in dock["controllers"].items():
        assert counters["samples_handed_out"] == G * N, state
    written = sum(w["bytes_in"] for w in dock["warehouses"])
    read = sum(w["bytes_out"] for w in dock["warehouses"])
    assert written > 0 and read > written  # columns are read by several states


def test_outputs_checkpoints_and_plot(interrupted_then_resumed):
    output, _, _ = interrupted_then_resumed
    checkpoints = sorted(p.name for p in (output / "checkpoints").iterdir())
    assert checkpoints == ["iter-000002", "iter-000004"]
    policy = output / "checkpoints" / "iter-000004" / "policy"
    assert (policy / "config.json").is_file() and (policy / "tokenizer.json").is_file()
    assert (output / "progress.png").stat().st_size > 0
    assert (output / "warmup" / "config.json").is_file()


def test_resuming_a_finished_run_adds_nothing(interrupted_then_resumed):
    output, _, _ = interrupted_then_resumed
    before = read_metrics(output)
    again = jobs.start(
        output.parent / "job.yaml",
        output,
        resume=True,
        max_restarts=None,
    )
    log, _ = again.communicate(timeout=600)
    assert again.returncode == 0, log
    assert read_metrics(output) == before


def test_output_dir_of_another_run_is_refused(interrupted_then_resumed):
    output, _, _ = interrupted_then_resumed
    refused = jobs.start(
        output.parent / "job.yaml",
        output,
        max_restarts=None,
    )
    log, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2
    assert "--resume" in log


def test_a_killed_worker_is_restarted_from_the_last_checkpoint(tmp_path, shared_ray_head):
    """SIGKILL one actor rank's process mid-run: the job restarts its workers from the last
    checkpoint by itself and still ends with every iteration logged exactly once. The test hold
    (driver/iteration_hold.py) keeps the job before iteration 4 until the kill has landed, so the kill
    always falls while the actor is still needed, after the checkpoint of iteration 2 (interval 2)."""
    iterations = 6
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_config(tmp_path / "model", iterations)))
    output, hold = tmp_path / "run", tmp_path / "hold"
    hold.write_text("4")
    job = jobs.start(config, output, max_restarts=1, env={**os.environ, "RLDOCK_TEST_HOLD_FILE": str(hold)})
    before = wait_for_output(job, "test hold: iteration 4 waits", timeout_s=600)
    # Ray names actor processes "ray::<class>[.method]": the actor rank is a seat of the device
    # worker under colocated placement (the default), "ray::ActorWorker" of its own under separate.
    # The job joined the tier's Ray head (conftest.py), whose raylet started them; it runs one job at
    # a time, so they are this job's.
    pids = [p.pid for p in shared_ray_head.worker_processes("ray::DeviceWorker", "ray::ActorWorker")]
    assert pids, "no actor worker process found"
    os.kill(pids[0], signal.SIGKILL)
    hold.unlink()
    log = before + job.communicate(timeout=600)[0]
    assert job.returncode == 0, log
    assert "a worker died" in log and "restart 1 of 1" in log
    assert [r["iteration"] for r in read_metrics(output)] == list(range(1, iterations + 1))


def test_sigterm_checkpoints_the_iteration_under_way_and_resume_continues_after_it(tmp_path):
    """SIGTERM to the driver (a pod deleted, a node drained, Kueue's suspension, `kill`): the iteration
    under way finishes and is checkpointed although no periodic checkpoint is due, the run exits 143,
    and --resume redoes nothing: every iteration is logged once, the resumed attempt starting after
    the stopped one's last. The test hold (driver/iteration_hold.py) keeps the job before iteration 3
    until the signal has landed, so the stop always falls on an iteration no periodic checkpoint saves
    (interval 2)."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(job_config(tmp_path / "model")))
    output, hold = tmp_path / "run", tmp_path / "hold"
    hold.write_text("3")
    environment = {**os.environ, "RLDOCK_TEST_HOLD_FILE": str(hold)}
    job = jobs.start(config, output, env=environment)
    # The signal must land while the job waits before iteration 3 (the hold logs it), not while it
    # checkpoints iteration 2, after which a stop rightly ends the run at 2.
    before = wait_for_output(job, "test hold: iteration 3 waits", timeout_s=600)
    os.kill(job.pid, signal.SIGTERM)  # the driver alone, as a pod's main process gets it
    hold.unlink()
    log = before + job.communicate(timeout=600)[0]
    assert job.returncode == 143, log
    assert "stopped by SIGTERM after iteration 3" in log
    assert [r["iteration"] for r in read_metrics(output)] == [1, 2, 3]
    assert (output / "checkpoints" / "iter-000003").is_dir()

    resumed = jobs.run(config, output, resume=True, max_restarts=None)
    assert "resuming after iteration 3" in resumed.stdout + resumed.stderr
    assert [r["iteration"] for r in resumed.records] == list(range(1, ITERATIONS + 1))
    # The prompt ledger (driver/prompt_ledger.py) of the last checkpoint: every group drawn trained once, in the
    # iteration that drew it; none lost at the stop, none trained twice, none left open.
    ledger = json.loads((output / "checkpoints" / f"iter-{ITERATIONS:06d}" / "ledger.json").read_text())
    assert ledger["summary"] == {
        "drawn": ITERATIONS * G,
        "trained": ITERATIONS * G,
        "passed_over": 0,
        "open": 0,
        "trained_twice": 0,
    }
    assert ledger["trained"] == {str(i): list(range((i - 1) * G, i * G)) for i in range(1, ITERATIONS + 1)}
    assert [r["prompts/trained_groups"] for r in resumed.records] == [G] * ITERATIONS
