"""Allgather-swap resharding in a real job: the demo config at TP 2 x DP 1 (two actor ranks, each
its own vLLM replica), once with `resharding: naive` and once with `allgather_swap`, same seed; and a
third time under `strategy: fsdp`, FSDP over the TP shards, which must start as the TP layout does and
run, stop and resume as it does.

The swap only moves bytes, so the two runs must train identically; its ledger must show no
training state on the device while generating, and naive's must show it there. Both runs stop
after iteration 3 and resume from their checkpoints (full weights, one optimizer shard per TP rank,
saved with the swap's state swapped in) for iteration 4. Both resume because a resumed TP 2 run
was not bit-identical to an uninterrupted one (observed: equal checkpoint weights and policy loss,
a different KL in the next iteration; cause not found yet; the TP 1 DDP path is bit-exact, see
test_ppo_job.py).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from jobs import TP2_ITERATIONS  # tests/jobs.py

pytestmark = pytest.mark.integration

ITERATIONS = TP2_ITERATIONS  # 3, then resumed for the 4th
TRAIN_STATE = ("train_params", "grads", "optimizer_state")


@pytest.fixture(scope="module")
def runs(tp2_resharding_runs):
    return tp2_resharding_runs  # the session's runs (conftest.py), shared with test_generation_tp_job


def test_swap_trains_exactly_like_naive_across_a_resume(runs):
    naive = [r["loss"] for r in runs["naive"][1]]
    swap = [r["loss"] for r in runs["allgather_swap"][1]]
    assert len(naive) == len(swap) == ITERATIONS
    assert len(set(naive)) > 1  # the policy moves: equal losses are not a constant
    assert swap == naive


# What FSDP over the TP shards must reproduce of the TP layout's run at its first iteration, which both
# generate from the same weights: the same rollout, and the same update up to float32 rounding (FSDP's
# reduction over a group of one, its norm summed in float64 over two meshes, AdamW on DTensors). Later
# iterations generate from weights that differ by that rounding, which may flip a sampled token; the
# update's numbers at any layout are checked on fixed batches by test_fsdp_tensor_parallel_ranks.py.
SAME_ROLLOUT = ("reward_mean", "reward_std", "response_length_mean")
SAME_UPDATE = ("loss", "kl", "entropy", "grad_norm", "flops/update")


def test_fsdp_over_the_tp_shards_trains_like_the_tp_layout_across_a_resume(runs):
    """`strategy: fsdp` at tensor_parallel_size 2 (FSDP2 on TP's DTensors, the training mesh's sequence
    ranks by its TP pair): the TP layout's first iteration, then every iteration once across a stop and a
    resume from its checkpoint (a whole optimizer file gathered from 2-D shards), swapped out while
    generating, the policy moving."""
    tp, fsdp = runs["allgather_swap"][1], runs["fsdp"][1]
    assert [r["iteration"] for r in fsdp] == list(range(1, ITERATIONS + 1))
    for key in SAME_ROLLOUT:
        assert fsdp[0][key] == tp[0][key], key
    for key in SAME_UPDATE:  # flops/update: a TP pair's passes count once, as the TP layout's
        assert fsdp[0][key] == pytest.approx(tp[0][key], rel=1e-4, abs=1e-7), key
    for record in fsdp:
        assert all(math.isfinite(record[key]) for key in SAME_UPDATE) and record["grad_norm"] > 0
        for rank in (0, 1):
            assert _train_state_during_generation(record, rank) == 0
    assert len({record["kl"] for record in fsdp}) > 1  # the policy moves away from the reference
    output, _ = runs["fsdp"]
    (checkpoint,) = (output / "checkpoints").glob(f"*{ITERATIONS:06d}")
    assert (checkpoint / "optimizer.pt").is_file() and not (checkpoint / "optimizer.tp1.pt").exists()


def _train_state_during_generation(record: dict, rank: int) -> int:
    ledger = record["ledger"]
    return sum(ledger[f"memory/rank{rank}/generation/{category}"] for category in TRAIN_STATE)


def test_ledger_shows_no_training_state_during_generation_with_swap(runs):
    for record in runs["allgather_swap"][1]:
        for rank in (0, 1):
            assert _train_state_during_generation(record, rank) == 0
            assert record["ledger"][f"memory/rank{rank}/generation/temp_buffer"] == 0
            assert record["ledger"][f"memory/rank{rank}/generation/host_swap"] > 0
            # back on the device for the update: the swap-in really restored the bytes
            assert record["ledger"][f"memory/rank{rank}/update_start/train_params"] > 0
    for record in runs["naive"][1]:
        for rank in (0, 1):
            assert _train_state_during_generation(record, rank) > 0
            assert record["ledger"][f"memory/rank{rank}/generation/host_swap"] == 0


def test_checkpoint_holds_full_weights_and_every_tp_shard_of_the_optimizer(runs):
    from safetensors.torch import load_file

    weights = {}
    for mode in ("naive", "allgather_swap"):
        output, _ = runs[mode]
        (checkpoint,) = (output / "checkpoints").glob(f"*{ITERATIONS:06d}")
        weights[mode] = load_file(checkpoint / "policy" / "model.safetensors")
        config = json.loads((checkpoint / "policy" / "config.json").read_text())
        assert weights[mode]["model.layers.0.mlp.up_proj.weight"].shape == (
            config["intermediate_size"],
            config["hidden_size"],
        )
        assert (checkpoint / "optimizer.pt").is_file() and (checkpoint / "optimizer.tp1.pt").is_file()
    naive, swap = weights["naive"], weights["allgather_swap"]
    assert naive.keys() == swap.keys()
    assert all(torch.equal(naive[name], swap[name]) for name in naive)  # swapped in before the save
