"""Resharding pieces that need no process group: layouts, the shard map, bucketing, slicing,
the swap and the ledger, on hand-computed numbers."""

from __future__ import annotations

import pytest
import torch

from rldock.contract.tensor_parallel import TP_PLANS, check_divisible
from rldock.runtime.resharding.gather import ParamEntry, allocate_buffers, plan_buckets
from rldock.runtime.resharding.ledger import ledger_entry, ledger_metrics, resident_bytes, train_state_bytes
from rldock.runtime.resharding.parallel_layout import ParallelLayout, ReshardPlan, has_partial_gradient, shard_dim
from rldock.runtime.resharding.shard import GenerationWeights, generation_items, generation_shard
from rldock.runtime.resharding.swap import SwapIn, TensorSwapper, make_storages_resizable

CPU = torch.device("cpu")


def test_layout_ranks_are_tp_major():
    layout = ParallelLayout(tp_size=2, dp_size=3)
    assert layout.world_size == 6
    assert [layout.tp_rank(r) for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [layout.dp_rank(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert layout.tp_group_ranks(3) == [2, 3]


def test_generation_replicas_of_consecutive_ranks_hold_one_engine_each():
    # 4 actor ranks (say training TP 2 x DP 2) in generation replicas of 2: engines on ranks 0 and 2,
    # which generate for their replica (ranks 0-1 and 2-3); generation TP 1: an engine on every rank.
    generation = ParallelLayout.over(4, tp_size=2, field="rollout.tensor_parallel_size")
    assert generation.leaders() == [0, 2]
    assert [generation.tp_rank(r) == 0 for r in range(4)] == [True, False, True, False]
    assert generation.tp_group_ranks(3) == [2, 3]
    assert ParallelLayout.over(4, tp_size=1, field="f").leaders() == [0, 1, 2, 3]
    assert ParallelLayout.over(4, tp_size=4, field="f").leaders() == [0]
    with pytest.raises(ValueError, match=r"rollout\.tensor_parallel_size=3 must divide the 4 actor ranks"):
        ParallelLayout.over(4, tp_size=3, field="rollout.tensor_parallel_size")


def test_plan_needs_the_same_ranks():
    ReshardPlan(train=ParallelLayout(2, 1), generate=ParallelLayout(1, 2))
    with pytest.raises(ValueError, match="same ranks"):
        ReshardPlan(train=ParallelLayout(2, 2), generate=ParallelLayout(1, 2))


@pytest.mark.parametrize(
    "name, dim",
    [
        ("model.layers.0.self_attn.q_proj.weight", 0),
        ("model.layers.3.self_attn.v_proj.bias", 0),
        ("model.layers.1.self_attn.o_proj.weight", 1),
        ("model.layers.1.mlp.up_proj.weight", 0),
        ("model.layers.12.mlp.down_proj.weight", 1),
        ("model.layers.0.input_layernorm.weight", None),
        ("model.embed_tokens.weight", None),
        ("lm_head.weight", None),
    ],
)
def test_shard_dim_map(name, dim):
    for model_type, plan in TP_PLANS.items():  # the grouped-query architectures name their linears alike
        if model_type != "deepseek_v3":  # a MoE plan splits no MLP
            assert shard_dim(name, plan) == (None if ".mlp." in name and not plan.splits_mlp else dim)


@pytest.mark.parametrize(
    "name, dim",
    [
        ("model.layers.0.self_attn.q_proj.weight", 0),  # the query, or with a query latent its up-projection
        ("model.layers.0.self_attn.q_b_proj.weight", 0),
        ("model.layers.2.self_attn.kv_b_proj.weight", 0),  # the latent up to each head's keys and values
        ("model.layers.1.self_attn.o_proj.weight", 1),
        ("model.layers.0.self_attn.q_a_proj.weight", None),  # the down-projections to the latents stay whole
        ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", None),
        ("model.layers.0.self_attn.kv_a_layernorm.weight", None),
        ("model.layers.0.mlp.gate_proj.weight", None),  # the dense layers' MLP too
        ("model.layers.1.mlp.shared_experts.down_proj.weight", None),
    ],
)
def test_deepseek_v3s_latent_attention_splits_by_heads(name, dim):
    assert shard_dim(name, TP_PLANS["deepseek_v3"]) == dim


@pytest.mark.parametrize(
    "name, partial",
    [
        ("model.layers.0.self_attn.q_norm.weight", True),  # Qwen3: per-head norms see local heads only
        ("model.layers.5.self_attn.k_norm.weight", True),
        ("model.layers.0.input_layernorm.weight", False),  # sees the whole (replicated) hidden state
        ("model.norm.weight", False),
        ("model.layers.0.self_attn.q_proj.weight", False),  # split, not replicated
    ],
)
def test_partial_gradient_map(name, partial):
    assert has_partial_gradient(name, TP_PLANS["qwen3"]) is partial
    assert has_partial_gradient(name, TP_PLANS["qwen2"]) is False  # no per-head norms there


def test_uneven_split_is_refused_naming_the_field():
    check_divisible(tp_size=2, num_heads=4, num_kv_heads=2, intermediate_size=128, field="f")
    with pytest.raises(ValueError, match=r"training.tensor_parallel_size=2 .*num_key_value_heads \(1\)"):
        check_divisible(
            tp_size=2, num_heads=4, num_kv_heads=1, intermediate_size=128, field="training.tensor_parallel_size"
        )


def _entry(name, numel, dtype=torch.float32):
    return ParamEntry(name, dtype, (numel,), (numel,), None)


def test_buckets_per_dtype_in_order_with_oversize_alone():
    # float32: 10 elements = 40 bytes; bf16 10 elements = 20 bytes. Bucket: 100 bytes.
    entries = [
        _entry("a", 10),
        _entry("b", 10, torch.bfloat16),
        _entry("c", 10),
        _entry("d", 10),
        _entry("e", 50),
        _entry("f", 10),
    ]
    buckets = plan_buckets(entries, bucket_bytes=100)
    names = [[e.name for e in bucket] for bucket in buckets]
    # a+c = 80, adding d (120) closes it; e (200 bytes) alone; f starts the next; bf16 b on its own.
    assert names == [["a", "c"], ["d"], ["e"], ["f"], ["b"]]
    with pytest.raises(ValueError):
        plan_buckets(entries, bucket_bytes=0)


def test_one_contiguous_buffer_per_dtype():
    entries = [
        ParamEntry("w", torch.float32, (2, 3), (4, 3), 0),
        _entry("n", 5, torch.bfloat16),
        ParamEntry("v", torch.float32, (2,), (2,), None),
    ]
    gathered = allocate_buffers(entries, CPU)
    assert {dtype: buf.numel() for dtype, buf in gathered.buffers.items()} == {torch.float32: 14, torch.bfloat16: 5}
    assert gathered.views["w"].shape == (4, 3)
    f32 = gathered.buffers[torch.float32]
    assert gathered.views["v"].data_ptr() == f32.data_ptr() + 12 * 4  # right after w
    assert gathered.nbytes == 14 * 4 + 5 * 2
    gathered.free()
    assert f32.untyped_storage().nbytes() == 0 and gathered.views == {}


def test_generation_shard_slices_views_of_the_full_weight():
    full = torch.arange(24.0).view(4, 6)
    q = "model.layers.0.self_attn.q_proj.weight"
    o = "model.layers.0.self_attn.o_proj.weight"
    plan = TP_PLANS["qwen2"]
    assert generation_shard(q, full, tp_rank=1, tp_size=2, plan=plan).tolist() == full[2:].tolist()
    right = generation_shard(o, full, tp_rank=1, tp_size=2, plan=plan)
    assert right.tolist() == full[:, 3:].tolist()
    assert right.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()  # a view, no copy
    assert generation_shard("model.norm.weight", full, tp_rank=1, tp_size=2, plan=plan) is full
    assert generation_shard(q, full, tp_rank=0, tp_size=1, plan=None) is full  # TP 1 needs no plan


def test_generation_weights_load_in_place_and_check_shapes():
    q = "model.layers.0.self_attn.q_proj.weight"
    gathered = allocate_buffers([ParamEntry(q, torch.float32, (4, 2), (4, 2), None)], CPU)
    gathered.views[q].copy_(torch.arange(8.0).view(4, 2))
    plan = TP_PLANS["llama"]
    weights = GenerationWeights(gathered.shapes, dtype=torch.float32, device=CPU, tp_rank=1, tp_size=2, plan=plan)
    before = weights.tensors[q]
    weights.load(generation_items(gathered, tp_rank=1, tp_size=2, plan=plan))
    assert weights.tensors[q] is before and before.tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert weights.nbytes == 16
    with pytest.raises(ValueError, match=q):
        weights.load([(q, torch.zeros(4, 2))])


def test_swap_keeps_tensor_identity_views_and_values():
    param = torch.nn.Parameter(torch.arange(6.0))
    view = param.data[2:4]
    state = torch.full((3,), 7, dtype=torch.int64)
    swapper = TensorSwapper(pin_memory=False)
    moved = swapper.swap_out({"train_params": [param, view], "optimizer_state": [state]})
    assert moved == 6 * 4 + 3 * 8  # the view shares param's storage and is not counted twice
    assert param.untyped_storage().nbytes() == 0 and state.untyped_storage().nbytes() == 0
    assert swapper.swapped_bytes == moved
    with pytest.raises(RuntimeError, match="already on host"):
        swapper.swap_out({"train_params": [param]})
    assert swapper.swap_in(["train_params"]) == 24
    assert param.tolist() == [0, 1, 2, 3, 4, 5] and view.tolist() == [2, 3]
    assert state.untyped_storage().nbytes() == 0  # not asked for yet
    pending = SwapIn(swapper, ["optimizer_state"], device=CPU)
    assert pending.wait() == 24
    assert state.tolist() == [7, 7, 7]
    host = swapper.host
    swapper.swap_out({"train_params": [param]})
    assert swapper.host is host  # the host buffer is reused, not reallocated
    swapper.swap_in()


def test_swapped_state_can_come_back_for_a_checkpoint_and_go_out_again():
    param = torch.nn.Parameter(torch.arange(4.0))
    grad = torch.ones(4)
    swapper = TensorSwapper(pin_memory=False)
    swapper.swap_out({"train_params": [param], "grads": [grad]})
    on_host = swapper.swapped()
    assert sorted(on_host) == ["grads", "train_params"]
    assert swapper.swap_in() == 32
    assert param.tolist() == [0, 1, 2, 3]  # what a checkpoint reads
    assert swapper.swap_out(on_host) == 32  # the same storages, through the byte views
    assert param.untyped_storage().nbytes() == 0 and grad.untyped_storage().nbytes() == 0
    swapper.swap_in(["grads"])
    assert grad.tolist() == [1, 1, 1, 1] and param.untyped_storage().nbytes() == 0


def test_ledger_counts_distinct_resident_storages_by_category():
    a = torch.zeros(10)  # 40 bytes
    b = torch.zeros(5, dtype=torch.float64)  # 40 bytes
    buffer = torch.zeros(3)  # 12 bytes
    assert resident_bytes([a, a[:2], b], device_type="cpu") == 80
    assert resident_bytes([a], device_type="cuda") == 0
    entry = ledger_entry(
        "generation",
        {"train_params": [a], "grads": [a[1:]], "optimizer_state": [b], "temp_buffer": [buffer]},
        device=CPU,
        kv_cache_bytes=1000,
        host_swap_bytes=7,
    )
    assert entry["device_bytes"] == {
        "train_params": 40,
        "grads": 0,
        "optimizer_state": 40,
        "generation_weights": 0,
        "temp_buffer": 12,
        "kv_cache": 1000,
    }
    assert entry["allocator"] is None and train_state_bytes(entry) == 80
    b.untyped_storage().resize_(0)
    assert resident_bytes([b], device_type="cpu") == 0
    metrics = ledger_metrics([entry], rank=1)
    assert metrics["memory/rank1/generation/optimizer_state"] == 40
    assert metrics["memory/rank1/generation/host_swap"] == 7
    assert "memory/rank1/generation/allocator" not in metrics


def test_memory_mapped_weights_are_copied_once_so_the_swap_can_free_them():
    import numpy as np

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.from_numpy(np.arange(4, dtype=np.float32)))  # like a mmap'd file
    module.bias = torch.nn.Parameter(torch.zeros(2))
    param = module.weight
    swapper = TensorSwapper(pin_memory=False)
    with pytest.raises(RuntimeError, match="make_storages_resizable"):
        swapper.swap_out({"train_params": [module.bias, module.weight]})
    assert module.bias.untyped_storage().nbytes() == 8  # refused before anything moved
    assert make_storages_resizable(module) == 1
    assert module.weight is param and param.tolist() == [0, 1, 2, 3]
    swapper.swap_out({"train_params": [module.weight]})
    swapper.swap_in()
    assert param.tolist() == [0, 1, 2, 3]
