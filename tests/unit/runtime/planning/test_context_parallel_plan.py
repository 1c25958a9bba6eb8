"""The memory planner under context parallelism (planning/context_parallel_bytes.py), Ulysses and ring:
a CP rank's activations by hand, the training state sharded over DP x CP, the bytes a rank sends in
an update step, and the verdict naming training.context_parallel_size when a sequence's
activations, not the model, fill the device (under ring, at a size no head count allows Ulysses)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from rldock.config import parse_job_config
from rldock.runtime.planning import PRESETS, ModelShape, check_fit, plan_memory
from rldock.runtime.planning.context_parallel_bytes import ring_block_bytes
from rldock.runtime.planning.memory import GIB, activation_bytes, training_state_bytes, update_all_to_all_bytes
from rldock.runtime.planning.report import plan_json, plan_table

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
# 2 layers, hidden 8, 4 heads of 2, 2 KV heads (CP 2 splits both), MLP 16, vocab 10.
SMALL = ModelShape(
    "small",
    vocab_size=10,
    hidden_size=8,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=2,
    intermediate_size=16,
    tie_word_embeddings=True,
)
# float32 bytes per token a layer keeps whatever the compute dtype: the two norms' inputs and reciprocal roots,
# a log-sum-exp per head (planning/activations.py)
FLOAT32 = 4 * (2 * (8 + 1) + 4)
FINAL_NORM = 4 * (8 + 1) + 2 * 8 * 4  # per token, once per pass: the final norm's, float32 here


def job(**training):
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())  # G 16 x N 8, DP 2, PL 8 + SL 6
    data["training"].update(strategy="fsdp", **training)
    data["resources"].update(device="npu", devices_per_node=8)
    return parse_job_config(data)


def test_a_cp_rank_keeps_its_share_of_the_tokens_and_the_whole_mask():
    tokens, rank_tokens = 2 * (8 + 6), 14  # a pass of 2 sequences; CP 2 computes 14 positions a rank
    per_token = 4 * 8 + (4 + 2 * 2) * 2 + 4 * 2 + 4 * 16  # norms, q/k/v, attention output, MLP
    kernel_output = 4 * 2  # under CP the kernel's output is a tensor apart from the exchanged one
    mask = tokens * tokens  # one boolean byte per pair of the packed pass
    # the transient: a layer's backward working set (the residual stream's gradient, h 8, and the MLP's two
    # I-wide gradients, 2 x 16, a position), more than the head's chunk (3 x 10 a position) at vocabulary 10
    working = rank_tokens * (8 + 2 * 16) * 4
    cp2 = activation_bytes(job(micro_batch_size=2, context_parallel_size=2), SMALL)
    assert (
        cp2 == 2 * rank_tokens * ((per_token + kernel_output) * 4 + FLOAT32) + rank_tokens * FINAL_NORM + mask + working
    )
    cp1 = activation_bytes(job(micro_batch_size=2), SMALL)
    assert cp1 == 2 * tokens * (per_token * 4 + FLOAT32) + tokens * FINAL_NORM + tokens * (8 + 2 * 16) * 4


def test_fsdp_shards_the_training_state_over_dp_x_cp_ranks():
    params = SMALL.num_params * 4
    assert training_state_bytes(job(context_parallel_size=2), SMALL) == (params // 4, params // 4, params // 2)


def test_all_to_all_bytes_of_an_update_step_by_hand():
    # A rank's mini-batch: 16 x 8 / DP 2 = 64 rows in passes of 2: 32 passes. Per pass and layer a rank
    # sends half of its 14 positions' q (4 heads), k, v (2 each) and output (4): 14 x 12 x 2 x 4 / 2 bytes,
    # forward and backward, and once more with the forward recomputed under gradient checkpointing.
    per_layer = 14 * 12 * 2 * 4 // 2
    cfg = job(micro_batch_size=2, context_parallel_size=2)
    assert update_all_to_all_bytes(cfg, SMALL) == 32 * 2 * per_layer * 2
    checkpointed = job(micro_batch_size=2, context_parallel_size=2, gradient_checkpointing=True)
    assert update_all_to_all_bytes(checkpointed, SMALL) == 32 * 2 * per_layer * 3
    assert update_all_to_all_bytes(job(micro_batch_size=2), SMALL) == 0
    # Under PP 2 a CP rank's stage holds one of the 2 layers: the same 32 passes through one layer
    staged = job(micro_batch_size=2, context_parallel_size=2, pipeline_parallel_size=2)
    assert update_all_to_all_bytes(staged, SMALL) == 32 * 1 * per_layer * 2
    plan = plan_memory(cfg, SMALL)
    assert plan_json(plan, None)["all_to_all_bytes"] == plan.all_to_all_bytes
    assert "DP 2 x CP 2 x TP 1" in plan_table(plan, None)


def _long_7b(context_parallel_size: int):
    data = yaml.safe_load((EXAMPLES / "grpo-qwen2.5-7b-paper.yaml").read_text())
    data["algorithm"]["max_response_length"] = 131072  # a 133K-token trajectory
    data["rollout"].update(dtype="bfloat16", gpu_memory_utilization=0.3)
    data["training"]["context_parallel_size"] = context_parallel_size
    data["resources"]["num_nodes"] = 8
    return parse_job_config(data)


def test_a_sequence_too_long_for_a_device_needs_cp_and_the_verdict_names_it():
    shape = PRESETS["qwen2.5-7b"]  # 28 heads, 4 KV heads: CP 2 or 4
    verdict = check_fit(_long_7b(1), shape, device_memory=48 * GIB)
    assert not verdict.fits and verdict.field == "training.context_parallel_size"
    assert "training.context_parallel_size >= 2" in verdict.message
    assert check_fit(_long_7b(2), shape, device_memory=48 * GIB).fits
    # Activations per rank fall with CP, less than 1/cp: the checkpointed layer inputs fall, the FSDP
    # state and the LM head's chunk do not.
    acts = [plan_memory(_long_7b(cp), shape).update.activations for cp in (1, 2, 4)]
    assert acts[0] > acts[1] > acts[2] > acts[0] / 4


def test_a_shape_whose_kv_heads_do_not_divide_gets_no_cp_verdict():
    shape = dataclasses.replace(PRESETS["qwen2.5-7b"], num_kv_heads=1)  # no CP size splits one KV head
    verdict = check_fit(_long_7b(1), shape, device_memory=48 * GIB)
    assert verdict.field != "training.context_parallel_size"


def test_a_ring_rank_keeps_its_own_heads_and_the_float32_merge():
    rank_tokens, mask = 14, 28 * 28  # as in the Ulysses case above
    per_token = 4 * 8 + (4 + 2 * 2) * 2 + 4 * 2 + 4 * 16
    merged = (4 * 2 + 4) * 4 // 4  # float32 output and log-sum-exps, in 4-byte elements
    # a backward step's two float32 (4 heads, 14, 14) score tiles and the (14, 14) boolean causal comparison, its
    # float32 output and query gradients (4 heads, 14, 2) and its key-and-value block (2, 2 KV heads, 14, 2) with
    # its float32 gradient, each twice (the ring's shift), beside the residual stream's gradient: more than the
    # MLP's two I-wide gradients (14 x 2 x 16 x 4 = 1,792)
    blocks = ring_block_bytes(SMALL, tokens=28, cp=2, tp=1, element=4)
    tiles, gradients, in_transit = 14 * 14 * (2 * 4 * 4 + 1), 2 * 4 * 14 * 2 * 4, 2 * (2 * 2 * 14 * 2) * (4 + 4)
    assert blocks == tiles + gradients + in_transit == 6_468 + 896 + 1_792
    working = rank_tokens * 8 * 4 + blocks
    ring = activation_bytes(job(micro_batch_size=2, context_parallel_size=2, context_parallel_mode="ring"), SMALL)
    assert ring == 2 * rank_tokens * ((per_token + merged) * 4 + FLOAT32) + rank_tokens * FINAL_NORM + mask + working
    # TP 2 leaves a rank two heads and one KV head; in float64 every tensor is float64; at CP 1 there is no ring
    assert ring_block_bytes(SMALL, tokens=28, cp=2, tp=2, element=4) == 3_332 + 448 + 896
    assert ring_block_bytes(SMALL, tokens=28, cp=2, tp=1, element=8) == 12_740 + 1_792 + 3_584
    assert ring_block_bytes(SMALL, tokens=28, cp=1, tp=1, element=4) == 0


def test_ring_bytes_of_an_update_step_by_hand():
    # Per pass and layer a rank passes on 1 key-and-value block of its 14 positions (2 KV heads of 2:
    # 14 x 2 x 2 x 2 elements of 4 bytes) forward; backward 1 block again and 2 blocks of gradients.
    block = 14 * 2 * 2 * 2 * 4
    cfg = job(micro_batch_size=2, context_parallel_size=2, context_parallel_mode="ring")
    assert update_all_to_all_bytes(cfg, SMALL) == 32 * 2 * (block + block + 2 * block)
    checkpointed = job(
        micro_batch_size=2, context_parallel_size=2, context_parallel_mode="ring", gradient_checkpointing=True
    )
    assert update_all_to_all_bytes(checkpointed, SMALL) == 32 * 2 * (2 * block + block + 2 * block)


def test_ring_gets_a_cp_verdict_where_no_size_divides_the_kv_heads():
    shape = dataclasses.replace(PRESETS["qwen2.5-7b"], num_kv_heads=1)  # Ulysses cannot split one KV head
    data = _long_7b(1).model_dump(mode="json", by_alias=True, exclude_none=True)
    data["training"]["context_parallel_mode"] = "ring"
    verdict = check_fit(parse_job_config(data), shape, device_memory=48 * GIB)
    assert not verdict.fits and verdict.field == "training.context_parallel_size"
    # A ring backward step holds two float32 (28 heads, 512, 512) score tiles, 56 MiB whatever the length (whole
    # (n, n) blocks were 924 GiB at CP 2 for these 133,120-token sequences), and its O(n) gradients and blocks in
    # transit, 2.0 GiB at CP 2 (n 66,560) with this shape's one KV head; the job fits at CP 2, as under Ulysses.
    assert "(ring attention: each rank computes 1/2 of every sequence" in verdict.message
    n, heads, kv_heads, width = 66_560, 28, 1, shape.head_dim
    tiles = 512 * 512 * (2 * heads * 4 + 1)
    step = tiles + 2 * heads * n * width * 4 + 2 * (2 * kv_heads * n * width) * (2 + 4)
    assert ring_block_bytes(shape, tokens=133_120, cp=2, tp=1, element=2) == step
    assert 1.9 * GIB < step - tiles < 2.0 * GIB and tiles < 57 << 20


def test_a_trimmed_single_row_pass_holds_no_mask():
    one_row = activation_bytes(job(micro_batch_size=1, context_parallel_size=2), SMALL)
    untrimmed = activation_bytes(job(micro_batch_size=1, context_parallel_size=2, trim_padding=False), SMALL)
    assert untrimmed - one_row == 14 * 14  # the (1, 1, 14, 14) boolean mask of a padded row
