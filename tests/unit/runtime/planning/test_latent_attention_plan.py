"""The planner's DeepSeek-V3 shape (multi-head latent attention, leading dense layers, shared experts, the
router's bias): its counts against Hugging Face's DeepseekV3ForCausalLM and by hand, and the paper's 671B
layout (examples/grpo-deepseek-r1-671b-paper.yaml) planned, its figures by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.runtime.planning.memory import GIB, plan_memory
from rldock.runtime.planning.pipeline_stages import stage_layers
from rldock.runtime.planning.shapes import PRESETS, shape_from_hf_config
from rldock.runtime.planning.verdict import check_fit

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "grpo-deepseek-r1-671b-paper.yaml"
H, V = 7168, 129280
# one layer's MLA: q_a_proj and its norm, q_b_proj, kv_a_proj_with_mqa and its norm, kv_b_proj, o_proj
ATTENTION = H * 1536 + 1536 + 1536 * 128 * 192 + H * 576 + 512 + 512 * 128 * 256 + 128 * 128 * H
EXPERTS = 256 * 3 * H * 2048  # one MoE layer's routed experts
MOE_LAYER = ATTENTION + 2 * H + H * 256 + 256 + EXPERTS + 3 * H * 2048  # + norms, router and bias, shared expert
DENSE_LAYER = ATTENTION + 2 * H + 3 * H * 18432


def test_a_tiny_deepseek_v3_counts_as_hugging_face_builds_it():
    """Every parameter of DeepseekV3ForCausalLM, and the router's score-correction bias (a buffer the
    checkpoint holds), at a size of its own: MLA, a dense first layer, two shared experts."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        q_lora_rank=12,
        kv_lora_rank=10,
        qk_nope_head_dim=6,
        qk_rope_head_dim=4,
        v_head_dim=5,
        n_group=2,
        topk_group=1,
        tie_word_embeddings=False,
    )
    model = transformers.DeepseekV3ForCausalLM(config)
    shape = shape_from_hf_config(config.to_dict(), name="tiny")
    biases = sum(buffer.numel() for name, buffer in model.named_buffers() if "e_score_correction_bias" in name)
    assert biases == 2 * 8  # the two MoE layers'
    assert shape.num_params == sum(p.numel() for p in model.parameters()) + biases
    assert (shape.first_dense_layers, shape.num_moe_layers) == (1, 2)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    assert experts == 2 * shape.expert_params
    assert shape.active_params == shape.num_params - experts * 6 // 8  # 2 of 8 routed experts run


def test_the_671b_preset_is_deepseeks_671b_and_37b_active():
    shape = PRESETS["deepseek-r1-671b"]
    assert shape.attention.params(H) == ATTENTION == 187_107_328
    assert shape.layer_params == MOE_LAYER and shape.dense_layer_params == DENSE_LAYER
    assert shape.num_params == 2 * V * H + 3 * DENSE_LAYER + 58 * MOE_LAYER + H == 671_026_419_200
    assert shape.active_params == shape.num_params - 58 * 248 * 3 * H * 2048 == 37_552_297_472
    # MLA caches the 512-wide latent and the 64-wide rope key per token and layer, not 128 heads' K and V
    assert shape.kv_bytes_per_token(2) == 61 * (512 + 64) * 2


def _paper() -> object:
    return parse_job_config(yaml.safe_load(EXAMPLE.read_text()))


def test_the_paper_example_is_its_update_layout_on_384_devices():
    cfg = _paper()
    training = cfg.training
    sizes = (training.pipeline_parallel_size, training.tensor_parallel_size, training.data_parallel_size)
    assert sizes == (6, 4, 16) and training.expert_parallel_size == 16
    assert 6 * 4 * 16 == cfg.resources.num_nodes * cfg.resources.devices_per_node == 384
    assert cfg.resources.device_memory_gib == 64


def test_the_paper_layout_planned_by_hand():
    """PP 6 splits the 61 layers 11, 10, ... 10: stage 0 holds the 3 dense layers and 8 MoE layers, the others
    10 MoE layers each. A rank's expert shard and all-to-all are a 10-MoE-layer stage's; its training state the
    heaviest stage's (the last: 10 MoE layers, the LM head and the final norm) over 16 FSDP ranks, TP 4
    splitting the attention but for its down projections, norms, and leaving the MoE MLP whole."""
    shape, cfg = PRESETS["deepseek-r1-671b"], _paper()
    assert [shape.moe_layers_in(stage_layers(61, stage=s, stages=6)) for s in range(6)] == [8, 10, 10, 10, 10, 10]
    plan = plan_memory(cfg, shape, device_memory=64 * GIB)
    moe = plan.moe
    assert moe is not None and moe.experts_per_rank == 16
    assert moe.expert_bytes_per_rank == 10 * EXPERTS // 16 * 2
    tokens = 2048 + 8192  # one sequence a micro-batch
    assert moe.all_to_all_bytes == 10 * 2 * tokens * 8 * H * 2 * 15 // 16
    whole = ATTENTION - (H * 1536 + 1536 + H * 576 + 512)  # what TP splits of the attention
    last = V * H + 10 * (whole // 4 + MOE_LAYER - whole) + H
    assert plan.update.params == -(-last * 2 // 16)
    assert plan.update.training_state == 4 * plan.update.params
    assert (plan.micro_batches, plan.pipeline_bubble) == (192, 5 / 197)  # 384 x 8 / 16 samples a DP rank
    # eq. 3: 48 engines of TP 8, 8 on each stage's 64 ranks, each holding its stage's weights
    redundant = moe.redundant
    assert redundant.generation_replicas == 48
    stage_dense = [
        V * H + 3 * DENSE_LAYER + 8 * (MOE_LAYER - EXPERTS),
        *[10 * (MOE_LAYER - EXPERTS)] * 4,
        10 * (MOE_LAYER - EXPERTS) + V * H + H,
    ]
    stage_experts = [8 * EXPERTS] + [10 * EXPERTS] * 5
    paper = sum(8 * (d * 2 // 4 + e * 2 // 8) for d, e in zip(stage_dense, stage_experts, strict=True))
    assert redundant.paper_bytes == paper


def test_the_paper_layout_does_not_fit_64_gib_and_the_plan_says_why():
    """The engine: 671B in bfloat16 over TP 8 (at most a node's devices) is 156 GiB a device; the update's
    fullest device needs 75 GiB besides."""
    cfg, shape = _paper(), PRESETS["deepseek-r1-671b"]
    plan = plan_memory(cfg, shape, device_memory=64 * GIB)
    assert plan.generation.generation_weights == shape.num_params * 2 // 8
    assert plan.update.device_total > 64 * GIB
    verdict = check_fit(cfg, shape, device_memory=64 * GIB)
    assert not verdict.fits and verdict.field == "rollout.tensor_parallel_size"
    assert "rollout.tensor_parallel_size 8 already spans what a node's 8 devices allow" in verdict.message
