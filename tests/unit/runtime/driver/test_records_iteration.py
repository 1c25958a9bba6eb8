"""The metrics record of an iteration, built from hand-made stage results: what each key holds and
which keys a job's stages bring (rewards, a critic, partial rollout, a preference update)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rldock.runtime.algorithms.rollout_correction import MISMATCH_KEY, mismatch_metrics, mismatch_part
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.records import iteration_record
from rldock.runtime.rollout.partial import METRIC_KEYS


def timed(dispatch_s: float, compute_s: float, wait_s: float = 0.0, num_samples: int = 0, **metrics) -> StageResult:
    return StageResult(wait_s, dispatch_s, compute_s, num_samples, metrics)


def reward_state(total: float, count: int) -> dict:
    return {"sums": {"reward/digit_match": total}, "counts": {"reward/digit_match": count}, "errors": 0}


GRPO_RESULTS = {
    "rollout": [timed(0.1, 2.0, decode_steps=3), timed(0.3, 1.0, decode_steps=7)],
    "reward": [timed(0.05, 0.2, reward_metrics=reward_state(2.0, 4))],
    "update": [
        timed(0.2, 3.0, wait_s=1.0, num_samples=2, loss=0.5, kl=0.1, ledger={"memory/rank0/peak": 7}),
        timed(0.2, 3.5, wait_s=3.0, num_samples=2, loss=0.25, kl=0.3, ledger={"memory/rank1/peak": 8}),
    ],
}


def record_of(results: dict, **overrides) -> dict:
    arguments = dict(
        iteration=2,
        update_state="update",
        prompt_lengths=[4, 6],
        rewards=[1.0, 0.0, 1.0, 0.0],  # the samples' facts, as the driver read them from the dock
        response_lengths=[2, 4, 6, 8],
        put_seconds=0.5,
        seconds=10.0,
        cycle=12.0,
        num_prompts=2,
        num_responses=2,
        num_devices=2,
        rollout_counters=(),
        round_metrics={},
        data_metrics={},
    )
    return iteration_record(results, **{**arguments, **overrides})


def test_a_grpo_iteration_record():
    record = record_of(GRPO_RESULTS)
    assert list(record) == [
        "iteration",
        "reward_mean",
        "reward_std",
        "reward/digit_match",
        "reward/errors",
        "response_length_mean",
        "prompt_length_mean",
        "loss",
        "kl",
        "tokens_per_s_per_device",
        "rollout/num_engines",
        "ledger",
        "timing",
    ]
    assert (record["iteration"], record["reward_mean"], record["reward_std"]) == (2, 0.5, 0.5)
    assert (record["reward/digit_match"], record["reward/errors"]) == (0.5, 0)
    assert (record["response_length_mean"], record["prompt_length_mean"]) == (5.0, 5.0)
    assert record["loss"] == 0.375 and record["kl"] == pytest.approx(0.2)  # means over the update's ranks
    # G*N*(PL+SL)/devices/seconds = 2*2*(5+5)/2/10
    assert record["tokens_per_s_per_device"] == 2.0
    assert record["rollout/num_engines"] == 2
    assert record["ledger"] == {"memory/rank0/peak": 7, "memory/rank1/peak": 8}  # merged, not averaged
    timing = record["timing"]
    assert timing["rollout"] == 2.1 and timing["compute/rollout"] == 2.0  # the slowest rank's
    assert timing["update"] == 3.7 and timing["idle/update"] == 2.0  # idle: mean over the ranks
    assert timing["dispatch"] == pytest.approx(0.5 + 0.1 + 0.3 + 0.05 + 0.2 + 0.2)  # the driver's put and every rank's
    assert (timing["iteration"], timing["cycle"]) == (10.0, 12.0)


def test_the_first_iteration_of_a_loop_has_no_cycle_and_carries_the_data_metrics():
    data = {"data/num_prompts": 64, "data/dropped_prompts": 1}
    record = record_of(GRPO_RESULTS, cycle=None, data_metrics=data, round_metrics={"dapo/rounds": 2})
    assert "cycle" not in record["timing"]
    assert list(record)[-4:] == ["dapo/rounds", "data/num_prompts", "data/dropped_prompts", "timing"]


def test_partial_rollout_counts_both_rounds():
    results = {
        **GRPO_RESULTS,
        "rollout": [timed(0.1, 1.0, decode_steps=1, partial_cut=2, partial_carried_tokens=4)],
        "rollout_resume": [timed(0.1, 1.0, decode_steps=5, partial_resumed=2)],
    }
    # the dock's response lengths, the first round's two finished and the second's two completed
    record = record_of(results, rollout_counters=METRIC_KEYS, response_lengths=[2, 2, 6, 6])
    assert record["response_length_mean"] == 4.0
    assert (record["rollout/partial_cut"], record["rollout/partial_resumed"]) == (2, 2)
    assert record["rollout/partial_carried_tokens"] == 4 and record["rollout/partial_dropped"] == 0
    assert "rollout/partial_cut" not in record_of(results)  # only with partial rollout on


def test_a_preference_update_without_rollout_or_reward_reads_the_driver_responses():
    results = {
        "reference": [timed(0.1, 0.4, rank=0)],
        "preference_update": [timed(0.1, 1.0, num_samples=4, loss=0.6, preference_accuracy=0.75)],
    }
    record = record_of(results, update_state="preference_update", rewards=[], response_lengths=[3, 5])
    assert record["response_length_mean"] == 4.0
    assert "reward_mean" not in record and "rollout/num_engines" not in record
    assert record["preference_accuracy"] == 0.75 and "num_samples" not in record


def test_a_critic_brings_its_metrics():
    critic_update = timed(
        0.1, 1.0, rank=0, num_samples=4, value_loss=0.2, value_clip_fraction=0.0, value_mean=0.1, value_grad_norm=1.0
    )
    results = {
        **GRPO_RESULTS,
        "critic_inference": [timed(0.1, 0.5, rank=0, num_samples=4)],
        "critic_update": [critic_update],
    }
    record = record_of(results)
    assert record["value_loss"] == 0.2
    assert record["critic_ranks"] == {"rank0": {"inference_samples": 4, "update_samples": 4}}


def test_utilisation_brings_flops_mfu_and_mbu_per_stage():
    from rldock.runtime.driver.utilisation import DeviceRates, UtilisationInputs, forward_flops, update_flops
    from rldock.runtime.planning.shapes import ModelShape

    shape = ModelShape(
        "toy",
        vocab_size=32,
        hidden_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=16,
        tie_word_embeddings=True,
    )
    computed = {"tokens": 20, "pairs": 110, "head_positions": 8}
    results = {
        **GRPO_RESULTS,
        "update": [replace(rank, metrics={**rank.metrics, "computed": computed}) for rank in GRPO_RESULTS["update"]],
        "reference": [timed(0.0, 0.5, rank=0, computed=computed), timed(0.0, 0.25, rank=1, computed=computed)],
    }
    inputs = UtilisationInputs(
        shape=shape,
        rates=DeviceRates(peak_flops={"float32": 1e6}, bandwidth=1e6, shared=False),
        group_size=2,
        recompute=False,
        generation_tp=1,
        rollout_dtype="float32",
        training_dtype="float32",
        reference_dtype="float32",
    )
    record = record_of(results, utilisation=inputs)
    assert "computed" not in record  # summed into the FLOPs, not averaged as a training metric
    keys = [key for key in record if key.startswith(("flops/", "mfu/", "mbu/"))]
    assert keys == [
        "flops/reference",
        "flops/rollout",
        "flops/update",
        "mbu/rollout",
        "mfu/reference",
        "mfu/rollout",
        "mfu/update",
    ]
    both = {key: 2 * value for key, value in computed.items()}  # the two ranks' passes
    assert record["flops/update"] == update_flops(shape, **both, recompute=False)
    assert record["flops/reference"] == forward_flops(shape, **both)
    # the slowest rank's compute seconds, the stage's two devices at 1e6 FLOP/s each
    assert record["mfu/update"] == pytest.approx(record["flops/update"] / 3.5 / 2e6)
    assert record["mfu/reference"] == pytest.approx(record["flops/reference"] / 0.5 / 2e6)
    assert record["mfu/rollout"] == pytest.approx(record["flops/rollout"] / 2.0 / 2e6)
    assert record["mbu/rollout"] > 0
    shared = record_of(
        results, utilisation=UtilisationInputs(**{**vars(inputs), "rates": DeviceRates({"float32": 1e6}, 1e6, True)})
    )
    assert shared["mfu/update"] == pytest.approx(2 * record["mfu/update"])  # one CPU: the stage's devices are 1
    assert not any(key.startswith("mfu/") for key in record_of(results))  # no inputs, no utilisation


def test_the_old_logprob_pass_s_mismatch_parts_merge_over_its_ranks_and_batches():
    """algorithm.rollout_correction: each rank sends each batch's sums; the record merges them as one batch."""
    trainer = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -3.0], [-2.0, 0.0, 0.0], [-1.0, -1.5, -0.2]])
    engine = trainer + torch.tensor([[0.1, -0.2, 0.0], [0.0, 0.3, -0.1], [0.05, 0.0, 0.0], [-0.4, 0.1, 0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    rank0 = [mismatch_part(trainer[:1], engine[:1], mask[:1]), mismatch_part(trainer[1:2], engine[1:2], mask[1:2])]
    rank1 = [mismatch_part(trainer[2:], engine[2:], mask[2:])]
    results = {**GRPO_RESULTS, "actor_inference": [timed(0.1, 0.5, **{MISMATCH_KEY: p}) for p in (rank1, rank0)]}
    record = record_of(results)
    whole = mismatch_metrics(trainer, engine, mask)
    assert {key: record[key] for key in whole} == pytest.approx(whole, rel=1e-12)
    assert not any(key.startswith("mismatch/") for key in record_of(GRPO_RESULTS))  # only with a correction
