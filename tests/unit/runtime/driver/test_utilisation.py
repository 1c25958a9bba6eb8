"""The FLOP and byte count of driver/utilisation.py, by hand on SmolLM2-135M's shape and on small cases, and
the `mfu/` inputs a job's config and measurement give."""

from __future__ import annotations

import pytest

from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.utilisation import (
    DeviceRates,
    UtilisationInputs,
    decode_bytes,
    forward_flops,
    job_rates,
    rollout_flops,
    rollout_work,
    stage_utilisation,
    update_flops,
)
from rldock.runtime.planning.shapes import ModelShape, shape_from_hf_config

# SmolLM2-135M-Instruct's config.json (the fields the count reads)
SMOLLM2 = {
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def smollm2() -> ModelShape:
    return shape_from_hf_config(SMOLLM2, name="SmolLM2-135M-Instruct")


def test_smollm2s_shape_and_kv_bytes():
    shape = smollm2()
    assert shape.head_dim == 64 and shape.num_params == 134_515_008  # the published count, norms included
    assert shape.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4


def test_forward_flops_by_hand():
    shape = smollm2()
    # q, o: 576 x 576; k, v: 576 x 192; gate, up, down: 576 x 1536
    per_token = 2 * 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)  # 2 x the layers' matmul weights
    per_pair = 30 * 4 * 9 * 64  # q.k and the weighted sum of v, 9 heads of 64, per layer
    head = 2 * 576 * 49152
    assert forward_flops(shape, tokens=1, pairs=0, head_positions=0) == per_token == 212_336_640
    assert forward_flops(shape, tokens=0, pairs=1, head_positions=0) == per_pair
    assert forward_flops(shape, tokens=0, pairs=0, head_positions=1) == head
    assert (
        forward_flops(shape, tokens=50, pairs=1275, head_positions=10) == 50 * per_token + 1275 * per_pair + 10 * head
    )


def test_an_update_is_three_forwards_and_the_head_recomputed():
    shape = smollm2()
    layers = forward_flops(shape, tokens=100, pairs=5000, head_positions=0)
    head = forward_flops(shape, tokens=0, pairs=0, head_positions=40)
    assert update_flops(shape, tokens=100, pairs=5000, head_positions=40, recompute=False) == 3 * layers + 4 * head
    assert update_flops(shape, tokens=100, pairs=5000, head_positions=40, recompute=True) == 4 * layers + 4 * head


def test_the_rollout_prefills_each_group_once_and_decodes_all_but_the_last_token():
    # two groups of 2: prompts 4 and 6 tokens, responses of 3, 1, 2 and 0 tokens
    work = rollout_work([4, 6], [3, 1, 2, 0], group_size=2)
    assert (work.prefill_tokens, work.prefill_pairs) == (10, 10 + 21)  # P (P + 1) / 2 each
    assert work.decode_tokens == 2 + 0 + 1 + 0
    # at the mean prompt of 5: steps of 2 attend 6 + 7 keys, the step of 1 attends 6
    assert work.decode_pairs == (6 + 7) + 6
    assert work.head_positions == 4 + 3  # one per response after the prefill, one per decode step
    shape = smollm2()
    assert rollout_flops(shape, work) == forward_flops(shape, tokens=13, pairs=31 + 19, head_positions=7)
    # two engine steps reading every weight, and 19 keys' K and V
    assert (
        decode_bytes(shape, work, decode_steps=2, bytes_per_param=4) == 2 * 134_515_008 * 4 + 19 * 2 * 30 * 3 * 64 * 4
    )


def test_smollm2s_update_of_the_examples_shape_is_about_two_teraflops():
    """The example's shape (G8 x N4, prompts of 50, 40 response tokens scored) in rows: 2,880 tokens
    through the layers, 3 x 212 MFLOP each (1.83 TFLOP), the attention's 32 x 4,095 pairs (0.03) and
    the LM head 4x on 1,280 positions (0.29): about 2.15 TFLOP; packed, each prompt once per pass, less."""
    shape = smollm2()
    rows = 32 * (50 + 40)
    flops = update_flops(shape, tokens=rows, pairs=32 * 90 * 91 / 2, head_positions=32 * 40, recompute=False)
    assert 2.1e12 < flops < 2.2e12


def test_job_rates_take_the_config_before_the_measurement():
    measured = {
        "float32": {"peak_flops": 1.4e11, "bandwidth": 2e10},
        "bfloat16": {"peak_flops": 5e11, "bandwidth": 2e10},
    }
    rates = job_rates(
        peak_tflops=None, bandwidth_gbps=None, dtypes=["bfloat16", "float32"], measured=measured, device_kind="cpu"
    )
    assert (rates.peak_flops, rates.bandwidth, rates.shared) == ({"bfloat16": 5e11, "float32": 1.4e11}, 2e10, True)
    rates = job_rates(peak_tflops=989.0, bandwidth_gbps=3350.0, dtypes=["bfloat16"], measured={}, device_kind="cuda")
    assert rates.peak_flops["bfloat16"] == pytest.approx(9.89e14) and rates.bandwidth == pytest.approx(3.35e12)
    assert not rates.shared


def _inputs(rates: DeviceRates, **dtypes: str) -> UtilisationInputs:
    stages = {"rollout_dtype": "float32", "training_dtype": "float32", "reference_dtype": "float32", **dtypes}
    return UtilisationInputs(shape=smollm2(), rates=rates, group_size=2, recompute=False, generation_tp=1, **stages)


def test_each_stage_is_held_to_the_peak_and_bytes_of_the_dtype_it_computes_in():
    """vLLM on a CPU runs float32 while FSDP's mixed precision updates in bf16: the rollout's MFU is
    over the float32 peak and its decode reads float32 weights, the update's over the bf16 peak."""
    computed = {"tokens": 360, "pairs": 16380, "head_positions": 160}
    results = {
        "rollout": [StageResult(compute_s=1.0, metrics={"decode_steps": 3})],
        "update": [StageResult(compute_s=1.0, metrics={"computed": computed})],
        "reference": [StageResult(compute_s=1.0, metrics={"computed": computed})],
    }
    rates = DeviceRates(peak_flops={"float32": 1e12, "bfloat16": 4e12}, bandwidth=1e12, shared=False)
    mixed = stage_utilisation(
        results, _inputs(rates, training_dtype="bfloat16"), prompt_lengths=[5, 7], response_lengths=[3, 2, 4, 1]
    )
    plain = stage_utilisation(results, _inputs(rates), prompt_lengths=[5, 7], response_lengths=[3, 2, 4, 1])
    assert mixed["mfu/update"] == pytest.approx(plain["mfu/update"] / 4)
    assert mixed["mfu/rollout"] == plain["mfu/rollout"] and mixed["mbu/rollout"] == plain["mbu/rollout"]
    assert mixed["mfu/reference"] == plain["mfu/reference"]  # the reference ranks run model.dtype
    half = stage_utilisation(
        results, _inputs(rates, rollout_dtype="bfloat16"), prompt_lengths=[5, 7], response_lengths=[3, 2, 4, 1]
    )
    assert half["mbu/rollout"] == pytest.approx(plain["mbu/rollout"] / 2)  # 2-byte weights and KV cache
    assert half["mfu/rollout"] == pytest.approx(plain["mfu/rollout"] / 4)


def test_a_tensor_parallel_stage_counts_each_pass_once_over_all_its_devices():
    """TP 2 x DP 1: the leader reports the passes, its peer a zero tally (training backends'
    counts_passes); the stage's FLOPs are the TP 1 stage's and its MFU is over both devices."""
    shape = smollm2()
    passes = {"tokens": 360, "pairs": 16380, "head_positions": 160}
    nothing = {"tokens": 0, "pairs": 0, "head_positions": 0}
    inputs = _inputs(DeviceRates(peak_flops={"float32": 1e14}, bandwidth=1e12, shared=False))
    tp1 = {"update": [StageResult(compute_s=2.0, metrics={"computed": passes})]}
    tp2 = {
        "update": [
            StageResult(compute_s=2.0, metrics={"computed": passes}),
            StageResult(compute_s=1.5, metrics={"computed": nothing}),
        ]
    }
    one = stage_utilisation(tp1, inputs, prompt_lengths=[], response_lengths=[])
    two = stage_utilisation(tp2, inputs, prompt_lengths=[], response_lengths=[])
    expected = update_flops(shape, tokens=360, pairs=16380, head_positions=160, recompute=False)
    assert one["flops/update"] == two["flops/update"] == expected
    assert two["mfu/update"] == pytest.approx(expected / 2.0 / (2 * 1e14))
