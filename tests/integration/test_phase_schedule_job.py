"""The serial phase schedule on real local Ray (forced on CPU with resources.phase_schedule: serial):
on every shared device no two phases overlap in time and they run in the stated order, and the job
learns with the same metrics as with the schedule off (`overlap`, which logs no timeline)."""

from __future__ import annotations

import itertools
from collections import defaultdict

import jobs  # tests/jobs.py
import pytest
import yaml

pytestmark = pytest.mark.integration

G, N, ITERATIONS = 4, 4, 3


def run_job(
    tmp_path, *, name: str, schedule: str, algorithm: str = "grpo", dp: int = 2, tp: int = 1, recompute: str = "auto"
) -> list[dict]:
    config = tmp_path / f"{name}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": f"it-{name}",
                "seed": 1,
                "iterations": ITERATIONS,
                "model": {"path": str(tmp_path / "model"), "builder": "tiny-qwen2"},
                "algorithm": {
                    "name": algorithm,
                    "num_prompts_per_iteration": G,
                    "num_responses_per_prompt": N,
                    "max_prompt_length": 8,
                    "max_response_length": 6,
                    "learning_rate": 1e-4,
                    "recompute_old_logprobs": recompute,
                },
                "training": {"data_parallel_size": dp, "tensor_parallel_size": tp, "micro_batch_size": 4},
                "resources": {"phase_schedule": schedule},
                "dock": {"timeout_s": 120},
                "checkpoint": {"interval": ITERATIONS},
            }
        )
    )
    return jobs.run(config, tmp_path / name, max_restarts=None).records


def per_device(timeline: list[dict]) -> dict[int, list[dict]]:
    devices = defaultdict(list)
    for entry in timeline:
        devices[entry["device"]].append(entry)
    return {device: sorted(entries, key=lambda e: e["start"]) for device, entries in devices.items()}


def assert_serial(records: list[dict], expected: dict[int, list[tuple[str, str]]]) -> None:
    """Each iteration's phases on each device: (phase, worker) in `expected` order, none overlapping."""
    for record in records:
        devices = per_device(record["phases"])
        assert {d: [(e["phase"], e["worker"]) for e in entries] for d, entries in devices.items()} == expected, record[
            "iteration"
        ]
        for entries in devices.values():
            for before, after in itertools.pairwise(entries):
                assert before["end"] <= after["start"], (record["iteration"], before, after)


def learning_keys(record: dict) -> set[str]:
    return set(record) - {"phases"}


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_grpo_dp2_phases_take_turns_on_each_shared_device(tmp_path):
    # recompute always: the old-logprob pass runs too, so each device has four phases
    serial = run_job(tmp_path, name="serial", schedule="serial", recompute="always")
    assert [r["iteration"] for r in serial] == list(range(1, ITERATIONS + 1))
    assert_serial(
        serial,
        {
            d: [
                ("rollout", f"actor {d}"),
                ("actor_inference", f"actor {d}"),
                ("reference", f"reference {d}"),
                ("update", f"actor {d}"),
            ]
            for d in (0, 1)
        },
    )
    overlap = run_job(tmp_path, name="overlap", schedule="overlap", recompute="always")
    assert all("phases" not in r for r in overlap)
    assert [learning_keys(r) for r in serial] == [learning_keys(r) for r in overlap]
    for record in serial:
        assert 0.0 <= record["reward_mean"] <= 1.0 and record["kl"] >= 0.0


def test_ppo_tp2_critic_takes_turns_with_the_actor_rank_beside_it(tmp_path):
    # TP 2 x DP 1, colocated: {actor 0, reference 0}, {actor 1, critic}
    records = run_job(tmp_path, name="ppo", schedule="serial", algorithm="ppo", dp=1, tp=2)
    assert_serial(
        records,
        {
            0: [("rollout", "actor 0"), ("reference", "reference 0"), ("update", "actor 0")],
            1: [
                ("rollout", "actor 1"),
                ("critic_inference", "critic 0"),
                ("update", "actor 1"),
                ("critic_update", "critic 0"),
            ],
        },
    )
    assert records[-1]["value_loss"] >= 0
