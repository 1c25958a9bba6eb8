"""Each architecture's tensor-parallel plan (data, rldock.contract.tensor_parallel.TP_PLANS) against
a real tiny model of that architecture: every module the plan names exists, every split weight is a
decoder linear, and TP 4 shards of the real weights tile each full tensor."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from rldock.contract.tensor_parallel import TP_ARCHITECTURES, TP_PLANS, check_architecture, check_divisible, tp_plan
from rldock.runtime.resharding.parallel_layout import has_partial_gradient, shard_dim
from rldock.runtime.resharding.shard import generation_shard

MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
}
# A mixture-of-experts model's experts: few and narrow (their split is EP's, not the plan's). DeepSeek-V3's
# latent attention: every head reads the latent (as many KV heads as heads), here with a query latent too.
EXPERTS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        num_key_value_heads=8,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        rope_scaling=None,
    ),
}


def _tiny(model_type: str):
    """8 heads, 4 KV heads, MLP 64: every split dimension divides by 4."""
    config_cls, model_cls = MODELS[model_type]
    shape = dict(
        vocab_size=24,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        max_position_embeddings=16,
    )
    config = config_cls(**(shape | EXPERTS.get(model_type, {})))
    torch.manual_seed(0)
    return model_cls(config)


def test_every_architecture_with_a_plan_is_tested_and_checked():
    assert set(TP_ARCHITECTURES) == set(TP_PLANS) == set(MODELS)
    for model_type in TP_ARCHITECTURES:
        check_architecture(tp_size=4, model_type=model_type, field="training.tensor_parallel_size")
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel_size=2 needs .*'gemma'.*\['llama'"):
        check_architecture(tp_size=2, model_type="gemma", field="rollout.tensor_parallel_size")
    check_architecture(tp_size=1, model_type="gemma", field="training.tensor_parallel_size")  # TP 1: no plan needed
    assert tp_plan("qwen3") is TP_PLANS["qwen3"]


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_plan_names_real_modules_of_the_architecture(model_type):
    model = _tiny(model_type)
    plan = TP_PLANS[model_type]
    layer = dict(model.model.layers[0].named_modules())
    # what the plan may name that a model lacks: DeepSeek-V3's query is one projection, or a latent's down- and
    # up-projection (the model above has the latter)
    assert set(plan.optional_linears) <= set(plan.linears)
    present = [suffix for suffix in plan.linears if suffix not in plan.optional_linears or suffix in layer]
    assert model_type != "deepseek_v3" or present == ["self_attn.q_b_proj", "self_attn.kv_b_proj", "self_attn.o_proj"]
    tails = [suffix for suffix, _ in plan.partial_output_tails]
    for suffix in (*present, *plan.partial_gradient_modules, *tails):
        assert suffix in layer, f"{model_type}: the plan names {suffix}, which the model lacks"
    for suffix in (*present, *tails):
        assert isinstance(layer[suffix], torch.nn.Linear)
    for _, field in plan.partial_output_tails:
        assert isinstance(getattr(model.config, field), int)
    names = [name for name, _ in model.named_parameters()]
    split = [name for name in names if shard_dim(name, plan) is not None]
    # a weight per linear, Qwen2's q/k/v biases; Qwen3's q/k/v/o have no bias, so neither has its MoE
    assert len(split) == 2 * len(present) + (2 * 3 if model_type == "qwen2" else 0)
    # Split or replicated with a partial gradient, never both; only Qwen3 has per-head norms.
    partial = [name for name in names if has_partial_gradient(name, plan)]
    assert not set(split) & set(partial)
    assert len(partial) == (2 * 2 if model_type.startswith("qwen3") else 0)


@pytest.mark.parametrize("model_type", sorted(MODELS))
def test_tp4_shards_of_the_real_weights_tile_them(model_type):
    model = _tiny(model_type)
    config, plan = model.config, TP_PLANS[model_type]
    check_divisible(
        tp_size=4,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size if plan.splits_mlp else None,
        field="training.tensor_parallel_size",
    )
    for name, full in model.state_dict().items():
        shards = [generation_shard(name, full, tp_rank=r, tp_size=4, plan=plan) for r in range(4)]
        dim = shard_dim(name, plan)
        if dim is None:
            assert all(shard is full for shard in shards), name
            continue
        assert all(shard.shape[dim] == full.shape[dim] // 4 for shard in shards), name
        assert torch.equal(torch.cat(shards, dim=dim), full), name
    if model_type == "deepseek_v3":  # (heads * (nope + v), kv_lora_rank): 2 heads per rank
        kv = model.model.layers[0].self_attn.kv_b_proj.weight
        name = "model.layers.0.self_attn.kv_b_proj.weight"
        assert generation_shard(name, kv, tp_rank=3, tp_size=4, plan=plan).shape == (2 * (4 + 8), 16)
        return
    q = model.model.layers[0].self_attn.q_proj.weight  # (heads * head_dim, hidden): 2 heads per rank
    assert generation_shard("model.layers.0.self_attn.q_proj.weight", q, tp_rank=3, tp_size=4, plan=plan).shape == (
        2 * 8,
        64,
    )
