"""The planner's MoE shapes and figures: total and active parameters against a real Qwen3-MoE model,
the expert shard per EP rank, and the all-to-all volume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.runtime.models import MODEL_BUILDERS, load_causal_lm
from rldock.runtime.planning.memory import plan_memory
from rldock.runtime.planning.shapes import PRESETS, shape_from_hf_config


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe"
    MODEL_BUILDERS.get("tiny-qwen3-moe")(path, texts=["12+7=19", "40-2=38"], seed=0)
    return path


def test_total_and_active_parameters_are_the_models(tiny_moe):
    shape = shape_from_hf_config(json.loads((tiny_moe / "config.json").read_text()), name="tiny")
    model = load_causal_lm(tiny_moe)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    # a token runs 2 of the 4 experts: half the experts' parameters are inactive
    assert shape.active_params == shape.num_params - experts // 2


def test_qwen3_30b_a3b_is_30b_total_3b_active():
    shape = PRESETS["qwen3-30b-a3b"]
    assert shape.num_params / 1e9 == pytest.approx(30.5, abs=0.1)  # the model card's 30.5B and 3.3B
    assert shape.active_params / 1e9 == pytest.approx(3.3, abs=0.1)


def _cfg(ep: int, dp: int = 8) -> object:
    return parse_job_config(
        {
            "iterations": 1,
            "model": {"path": "unused", "dtype": "bfloat16"},
            "data": {"generator": {"name": "addition"}},
            "reward": {"terms": [{"name": "digit_match"}]},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": dp,
                "num_responses_per_prompt": 2,
                "max_prompt_length": 64,
                "max_response_length": 64,
                "learning_rate": 1e-6,
            },
            "training": {
                "strategy": "fsdp",
                "data_parallel_size": dp,
                "expert_parallel_size": ep,
                "micro_batch_size": 1,
            },
            "resources": {"device": "npu", "devices_per_node": dp, "device_memory_gib": 64},
        }
    )


@pytest.mark.parametrize("ep", [1, 2, 8])
def test_expert_shards_and_all_to_all(ep):
    shape = PRESETS["qwen3-30b-a3b"]
    plan = plan_memory(_cfg(ep), shape)
    moe = plan.moe
    assert moe is not None and moe.experts_per_rank == 128 // ep
    assert moe.expert_bytes_per_rank == 48 * 128 * 3 * 2048 * 768 * 2 // ep
    # each of 128 tokens sends 8 copies of 2048 bf16 values and gets 8 back, per layer; (ep-1)/ep leave the rank
    assert moe.all_to_all_bytes == 48 * 2 * 128 * 8 * 2048 * 2 * (ep - 1) // ep
    # FSDP shards the state over the 8 ranks whatever EP is; a layer's gathered experts shrink with EP
    assert plan.update.params == plan_memory(_cfg(1), shape).update.params
    if ep > 1:
        assert plan.update.fsdp_gathered < plan_memory(_cfg(1), shape).update.fsdp_gathered


@pytest.mark.parametrize("ep", [2, 4])
def test_context_parallel_ranks_each_dispatch_their_slice(ep):
    """Under CP 2 (EP over the 4 x 2 sequence ranks) a rank routes half of each micro-batch's 128
    positions: its all-to-all halves, its expert shard is EP's."""
    cfg = _cfg(ep, 4)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"context_parallel_size": 2})})
    moe = plan_memory(cfg, PRESETS["qwen3-30b-a3b"]).moe
    assert moe is not None and moe.experts_per_rank == 128 // ep
    assert moe.all_to_all_bytes == 48 * 2 * 64 * 8 * 2048 * 2 * (ep - 1) // ep


def test_a_dense_model_has_no_moe_figures():
    assert plan_memory(_cfg(1), PRESETS["qwen2.5-7b"]).moe is None


@pytest.mark.parametrize(("dp", "gen_tp"), [(8, 1), (8, 4), (4, 2)])
def test_eq3_with_gep(dp, gen_tp):
    """The paper's R = GDP x (TW/UTP + EW/GEP) with GEP the engines' expert split (their TP), and what
    naive resharding under FSDP leaves: every rank 1/dp of both, over the GDP engines' first ranks."""
    shape = PRESETS["qwen3-30b-a3b"]
    cfg = _cfg(2, dp)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"tensor_parallel_size": gen_tp})})
    redundant = plan_memory(cfg, shape).moe.redundant
    experts = 48 * 128 * 3 * 2048 * 768 * 2  # bf16 bytes of every layer's experts
    dense = shape.num_params * 2 - experts
    gdp = dp // gen_tp
    assert (redundant.expert_weight_bytes, redundant.dense_weight_bytes) == (experts, dense)
    assert (redundant.generation_replicas, redundant.generation_expert_split) == (gdp, gen_tp)
    assert redundant.paper_bytes == gdp * (dense + experts // gen_tp)
    assert redundant.naive_bytes == gdp * (dense // dp + experts // dp)


def test_a_pipeline_stage_holds_and_dispatches_its_layers_experts_only():
    """PP 2 x DP 4 x EP 2: a rank's stage holds 24 of the 48 MoE layers, so its expert shard and its
    all-to-all halve, and eq. 3 sums each engine rank's stage's TW and EW (the first stage's layers and
    embedding, the last's layers, LM head and final norm)."""
    shape = PRESETS["qwen3-30b-a3b"]
    cfg = _cfg(2, 4)
    staged = cfg.model_copy(
        update={"training": cfg.training.model_copy(update={"pipeline_parallel_size": 2, "router_aux_loss_coef": 0})}
    )
    whole, half = plan_memory(cfg, shape).moe, plan_memory(staged, shape).moe
    assert whole is not None and half is not None
    assert half.expert_bytes_per_rank == 24 * 128 * 3 * 2048 * 768 * 2 // 2 == whole.expert_bytes_per_rank // 2
    assert half.all_to_all_bytes == whole.all_to_all_bytes // 2
    stage_experts = 24 * 128 * 3 * 2048 * 768
    layers_dense = 24 * (shape.layer_params - shape.expert_params)
    first, last = 151936 * 2048 + layers_dense, 151936 * 2048 + layers_dense + 2048
    # 8 actor ranks, an engine each: ranks 0-3 hold stage 0, 4-7 stage 1 (PP outermost)
    assert half.redundant.paper_bytes == 4 * (first * 2 + stage_experts * 2) + 4 * (last * 2 + stage_experts * 2)
    naive = 4 * (first * 2 // 4 + stage_experts * 2 // 4) + 4 * (last * 2 // 4 + stage_experts * 2 // 4)  # FSDP over 4
    assert half.redundant.naive_bytes == naive
    assert whole.redundant.paper_bytes == 4 * (
        whole.redundant.dense_weight_bytes + whole.redundant.expert_weight_bytes
    )  # at one stage, the whole model's (4 ranks, 4 engines)
    # twice the ranks and engines, each engine rank holding its stage's half of the model: R as at one stage
    assert half.redundant.paper_bytes == whole.redundant.paper_bytes


EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


def _example(name: str, **training) -> object:
    data = yaml.safe_load((EXAMPLES / name).read_text())
    data["training"].update(training)
    return parse_job_config(data)


# Figures at one stage, printed by the planner before it counted stages' layers (a9c73439) and after: the
# MoE figures, the training state, FSDP's gathered weights, activations and the peak, to the byte. The activations
# since the float32 bytes were counted (each norm's input and reciprocal root, the log-sum-exps) and the final norm
# (9-14% more here, gradient checkpointing on), and since a layer's backward working set is counted where it is
# more than the LM head's chunk (2-16% more: the residual stream's gradient and the MLP's two I-wide gradients of a
# 10,240-token pass), which changed no other figure.
ONE_STAGE_FIGURES = [
    (
        "grpo-qwen3-30b-a3b-paper.yaml",
        {},
        (3816515328, 1623213056, 4174766080, 34359738368, 7247757312, 28185722880, 281243222016, 15266061312),
    ),
    (
        "grpo-qwen3-30b-a3b-paper.yaml",
        {"data_parallel_size": 16, "expert_parallel_size": 4},
        (15266061312, 1925202944, 4174766080, 34359738368, 14495514624, 24159191040, 70310805504, 15266061312),
    ),
    (
        "grpo-qwen3-30b-a3b-paper.yaml",
        {"data_parallel_size": 32, "context_parallel_size": 2, "expert_parallel_size": 8},
        (3816515328, 1623213056, 2129326080, 34359738368, 7247757312, 14092861440, 281243222016, 15266061312),
    ),
    (
        "grpo-qwen3-30b-a3b-paper.yaml",
        {"data_parallel_size": 32, "tensor_parallel_size": 2, "expert_parallel_size": 4},
        (7519784448, 1887454208, 4079738880, 34359738368, 14495514624, 24159191040, 256585728000, 29761575936),
    ),
    ("grpo-qwen2.5-7b-paper.yaml", {}, (7615616512, 3112220672, 5506293760, 38078082560)),
    (
        "grpo-qwen2.5-32b-paper.yaml",
        {"data_parallel_size": 32, "tensor_parallel_size": 2},
        (4290209024, 4089501696, 9899499520, 34359738368),
    ),
]
PRESET_OF = {
    "grpo-qwen3-30b-a3b-paper.yaml": "qwen3-30b-a3b",
    "grpo-qwen2.5-7b-paper.yaml": "qwen2.5-7b",
    "grpo-qwen2.5-32b-paper.yaml": "qwen2.5-32b",
}


@pytest.mark.parametrize(("example", "training", "figures"), ONE_STAGE_FIGURES)
def test_figures_at_one_stage_are_those_before_stages_were_counted(example, training, figures):
    plan = plan_memory(_example(example, **training), PRESETS[PRESET_OF[example]], device_memory=64 << 30)
    update, moe = plan.update, plan.moe
    found = (update.training_state, update.fsdp_gathered, update.activations, plan.peak)
    if moe is not None:
        r = moe.redundant
        found += (moe.expert_bytes_per_rank, moe.all_to_all_bytes, r.paper_bytes, r.naive_bytes)
    assert found == figures
