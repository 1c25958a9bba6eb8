"""The memory planner's arithmetic (rldock.runtime.planning): parameter counts, training state per
rank under DDP and FSDP, activations, phases, and the verdict naming the field to change."""

import json
from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.runtime.planning import PRESETS, ModelShape, check_fit, plan_memory
from rldock.runtime.planning.memory import GIB, activation_bytes, training_state_bytes
from rldock.runtime.planning.shapes import load_shape, shape_from_hf_config

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
# A shape small enough to check by hand: 2 layers, hidden 8, 2 heads of 4, 1 KV head, MLP 16, vocab 10.
SMALL = ModelShape("small", vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, tie_word_embeddings=True)


def job(**training) -> object:
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["training"].update(training)
    data["resources"].update(device="npu", devices_per_node=8)
    return parse_job_config(data)


def test_presets_and_hf_configs_count_the_published_parameters():
    assert PRESETS["qwen2.5-7b"].num_params == 7_615_616_512
    assert PRESETS["qwen2.5-32b"].num_params == 32_763_876_352
    smollm2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
               "tie_word_embeddings": True}
    assert shape_from_hf_config(smollm2, name="SmolLM2-135M").num_params == 134_515_008


def test_small_shape_by_hand():
    # attention 8*8 + 2*8*4 + 8*8 = 192, MLP 3*8*16 = 384, norms 16: 592 per layer
    assert SMALL.layer_params == 592
    assert SMALL.num_params == 10 * 8 + 2 * 592 + 8
    assert SMALL.kv_bytes_per_token(4) == 2 * 2 * 1 * 4 * 4


def test_fsdp_divides_the_training_state_by_the_dp_size():
    ddp = training_state_bytes(job(strategy="ddp", data_parallel_size=2), SMALL)
    fsdp = training_state_bytes(job(strategy="fsdp", data_parallel_size=2), SMALL)
    params = SMALL.num_params * 4  # float32
    assert ddp == (params, params, 2 * params)
    assert fsdp == (params // 2, params // 2, params)


def test_freeze_embeddings_drops_their_grads_and_optimizer_state():
    frozen = training_state_bytes(job(freeze_embeddings=True), SMALL)
    assert frozen[1] == (SMALL.num_params - SMALL.embedding_params) * 4
    assert frozen[2] == 2 * frozen[1]


def test_activations_follow_the_stated_formula():
    cfg = job(micro_batch_size=2)
    tokens = 2 * (cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length)
    per_layer = tokens * (4 * 8 + (2 + 2) * 4 + 2 * 4 + 4 * 16) * 4
    logits = tokens * 10 * 4 * 2
    assert activation_bytes(cfg, SMALL) == 2 * per_layer + logits
    checkpointed = job(micro_batch_size=2, gradient_checkpointing=True)
    assert activation_bytes(checkpointed, SMALL) == 2 * tokens * 8 * 4 + per_layer + logits


def test_bf16_compute_halves_activation_elements():
    fp32 = activation_bytes(job(strategy="fsdp"), SMALL)
    bf16 = activation_bytes(job(strategy="fsdp", mixed_precision="bf16"), SMALL)
    cfg = job()
    logits = cfg.training.micro_batch_size * (cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length) * 80
    assert bf16 - logits == (fp32 - logits) // 2


def test_phases_allgather_swap_and_offload_move_the_state_to_the_host():
    memory = 64 * GIB
    naive = plan_memory(job(strategy="fsdp"), SMALL, device_memory=memory)
    assert naive.generation.training_state == naive.update.training_state > 0
    swapped = plan_memory(job(strategy="fsdp", resharding="allgather_swap"), SMALL, device_memory=memory)
    assert swapped.generation.training_state == 0 and swapped.generation.host == swapped.update.training_state
    offloaded = plan_memory(job(strategy="fsdp", fsdp_cpu_offload=True), SMALL, device_memory=memory)
    assert offloaded.update.training_state == 0 and offloaded.update.host == naive.update.training_state


def test_engine_takes_its_memory_share_and_keeps_the_rest_as_kv_cache():
    cfg = job()
    plan = plan_memory(cfg, SMALL, device_memory=64 * GIB)
    weights = SMALL.num_params * 4
    assert plan.update.generation_weights == weights
    assert plan.update.kv_cache == int(cfg.rollout.gpu_memory_utilization * 64 * GIB) - weights
    assert plan.kv_cache_tokens == plan.update.kv_cache // SMALL.kv_bytes_per_token(4)


def test_paper_7b_fits_64gib_with_fsdp_and_ddp_is_refused_naming_a_field():
    cfg = parse_job_config(yaml.safe_load((EXAMPLES / "grpo-qwen2.5-7b-paper.yaml").read_text()))
    shape = PRESETS["qwen2.5-7b"]
    assert check_fit(cfg, shape, device_memory=64 * GIB).fits
    ddp = cfg.model_copy(update={"training": cfg.training.model_copy(update={"strategy": "ddp", "mixed_precision": "none"})})
    verdict = check_fit(ddp, shape, device_memory=128 * GIB)  # fsdp alone fits 128 GiB
    assert not verdict.fits and verdict.field == "training.strategy"
    verdict = check_fit(ddp, shape, device_memory=64 * GIB)  # on 64 GiB only more ranks do
    assert not verdict.fits and verdict.field == "training.data_parallel_size" and ">= 32" in verdict.message


def test_refusal_names_the_first_single_change_that_fits():
    cfg = parse_job_config(yaml.safe_load((EXAMPLES / "grpo-qwen2.5-7b-paper.yaml").read_text()))
    no_checkpointing = cfg.model_copy(update={"training": cfg.training.model_copy(
        update={"gradient_checkpointing": False})})
    plan = plan_memory(no_checkpointing, PRESETS["qwen2.5-7b"], device_memory=64 * GIB)
    assert plan.peak > 64 * GIB
    verdict = check_fit(no_checkpointing, PRESETS["qwen2.5-7b"], device_memory=64 * GIB)
    assert verdict.field == "training.gradient_checkpointing"


@pytest.mark.parametrize("memory,field", [(64, "rollout.tensor_parallel_size"), (128, "model.dtype")])
def test_32b_replica_does_not_fit_one_device_in_float32(memory, field):
    cfg = parse_job_config(yaml.safe_load((EXAMPLES / "grpo-qwen2.5-32b-paper.yaml").read_text()))
    verdict = check_fit(cfg, PRESETS["qwen2.5-32b"], device_memory=memory * GIB)
    assert not verdict.fits and verdict.field == field


def test_a_model_path_under_home_is_expanded(tmp_path, monkeypatch):
    # model.path as the examples write it (~/.cache/...): the planner reads it as the trainer does.
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    smollm2 = {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30,
               "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
               "tie_word_embeddings": True}
    (tmp_path / "model" / "config.json").write_text(json.dumps(smollm2))
    assert load_shape(preset=None, model_path="~/model").num_params == 134_515_008


def test_generation_tp_splits_the_engine_weights_over_its_devices():
    data = yaml.safe_load((EXAMPLES / "grpo-qwen2.5-32b-paper.yaml").read_text())
    whole = plan_memory(parse_job_config(data), PRESETS["qwen2.5-32b"], device_memory=64 * GIB)
    data.setdefault("rollout", {})["tensor_parallel_size"] = 4
    split = plan_memory(parse_job_config(data), PRESETS["qwen2.5-32b"], device_memory=64 * GIB)
    assert split.generation.generation_weights == whole.generation.generation_weights // 4
    assert split.update.params == whole.update.params  # training is unchanged
