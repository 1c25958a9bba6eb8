"""The memory planner's arithmetic (rldock.runtime.planning): parameter counts, training state per
rank under DDP and FSDP, activations, phases (the engine asleep through the update on accelerators),
the PPO critic rank's device, and the verdict naming the field to change."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.runtime.cli import main
from rldock.runtime.planning import PRESETS, ModelShape, check_fit, plan_memory
from rldock.runtime.planning.memory import (
    GIB,
    LOGIT_CHUNK_BYTES,
    PhaseBytes,
    activation_bytes,
    compute_dtypes,
    critic_params,
    fsdp_gathered_bytes,
    fsdp_whole_gradient_bytes,
    head_chunk_bytes,
    micro_batch_tokens,
    plan_critic,
    training_state_bytes,
)
from rldock.runtime.planning.shapes import shape_from_hf_config
from rldock.runtime.planning.training_state import layer_params_per_tp_rank

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
# A shape small enough to check by hand: 2 layers, hidden 8, 2 heads of 4, 1 KV head, MLP 16, vocab 10.
SMALL = ModelShape(
    "small",
    vocab_size=10,
    hidden_size=8,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    tie_word_embeddings=True,
)
# What a layer of SMALL keeps in float32 per token whatever the compute dtype: its two RMSNorms' float32 inputs and
# reciprocal roots (2 x (h + 1)) and a log-sum-exp per head (planning/activations.py)
FLOAT32_PER_TOKEN = 4 * (2 * (8 + 1) + 2)
# the final norm's, once per pass on the last stage: its float32 input and root, two h-wide tensors of `element` bytes


def final_norm(tokens: int, element: int = 4) -> int:
    return tokens * (4 * (8 + 1) + 2 * 8 * element)


def job(**training) -> object:
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["training"].update(training)
    data["resources"].update(device="npu", devices_per_node=8)
    return parse_job_config(data)


def test_presets_and_hf_configs_count_the_published_parameters():
    assert PRESETS["qwen2.5-7b"].num_params == 7_615_616_512
    assert PRESETS["qwen2.5-32b"].num_params == 32_763_876_352
    smollm2 = {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "tie_word_embeddings": True,
    }
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


def test_fsdp_holds_the_lm_heads_and_one_layers_gradient_whole():
    """FSDP2 keeps the root's LM-head gradient whole until the root's reduce-scatter at the end of the
    backward, and copies each layer's whole gradient into a reduce-scatter input (measured at the
    update's peak: docs/scaling.md, section 9). SMALL: V x h = 80 head weights (tied), 592 per layer."""
    head, layer = 10 * 8, 592
    # float32 at DP 2: the head whole in place of its counted half, plus one layer whole
    assert fsdp_whole_gradient_bytes(job(strategy="fsdp"), SMALL) == head * 4 - head * 4 // 2 + layer * 4 == 2528
    # bf16 compute: the head's gradient in bf16, the reduce-scatter input in float32
    bf16 = job(strategy="fsdp", mixed_precision="bf16")
    assert fsdp_whole_gradient_bytes(bf16, SMALL) == head * 2 - head * 4 // 2 + layer * 4
    # a frozen head has no gradient; offloaded shards are on the host, so none of the head's is counted there
    assert fsdp_whole_gradient_bytes(job(strategy="fsdp", freeze_embeddings=True), SMALL) == layer * 4
    assert fsdp_whole_gradient_bytes(job(strategy="fsdp", fsdp_cpu_offload=True), SMALL) == head * 4 + layer * 4
    assert fsdp_whole_gradient_bytes(job(strategy="ddp"), SMALL) == 0  # DDP's gradients are whole in `grads`
    plan = plan_memory(job(strategy="fsdp"), SMALL, device_memory=64 * GIB)
    assert plan.update.fsdp_whole_grads == 2528 and plan.generation.fsdp_whole_grads == 0  # the backward's only


def test_under_fsdp_x_tp_a_rank_holds_and_gathers_its_tp_slice_of_the_linears_and_whole_norms():
    """TP's plan splits a layer's linears (576 of SMALL's 592 parameters) and leaves its two norms (2 x 8) whole
    on each TP rank; FSDP shards that over the data-parallel ranks, and gathers it (two layers' worth) and
    reduce-scatters its gradient over them alone: a TP rank's slice (measured byte for byte on gloo ranks,
    rldock_benchmarks.layout_memory: docs/scaling.md, section 11)."""
    cfg = job(strategy="fsdp", data_parallel_size=2, tensor_parallel_size=2)
    assert layer_params_per_tp_rank(SMALL, tp=2) == 576 // 2 + 16 == 304
    params = (10 * 8 + 2 * 304 + 8) * 4  # the tied vocabulary matrix, two layers' TP slices, the final norm
    assert training_state_bytes(cfg, SMALL) == (params // 2, params // 2, params)
    assert fsdp_gathered_bytes(cfg, SMALL) == (2 * 304 + 10 * 8) * 4
    assert fsdp_whole_gradient_bytes(cfg, SMALL) == 10 * 8 * 4 - 10 * 8 * 4 // 2 + 304 * 4
    # an MoE layer: TP splits its attention only; the router stays whole and EP leaves a rank 1/ep of the experts
    moe = PRESETS["qwen3-30b-a3b"]
    norms = 2 * 2048 + 2 * 128  # the layer's two norms and Qwen3's per-head q and k norms
    attention = moe.layer_params - moe.mlp_params - norms
    router = 2048 * 128
    assert layer_params_per_tp_rank(moe, tp=2, ep=8) == attention // 2 + norms + router + moe.expert_params // 8


def test_activations_follow_the_stated_formula():
    cfg = job(micro_batch_size=2)
    tokens = 2 * (cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length)
    per_layer = tokens * ((4 * 8 + (2 + 2) * 4 + 2 * 4 + 4 * 16) * 4 + FLOAT32_PER_TOKEN)
    logits = 3 * tokens * 10 * 4  # the head's chunk: every token of this pass, V = 10
    # a layer's backward working set: the residual stream's gradient (h 8) and the MLP's two I-wide gradients (16)
    working = tokens * (8 + 2 * 16) * 4
    assert working > logits  # the transient counted is the larger (vocabulary 10 here)
    assert activation_bytes(cfg, SMALL) == 2 * per_layer + final_norm(tokens) + working
    checkpointed = job(micro_batch_size=2, gradient_checkpointing=True)
    assert activation_bytes(checkpointed, SMALL) == 2 * tokens * 8 * 4 + per_layer + final_norm(tokens) + working


def test_bf16_compute_halves_activation_elements():
    fp32 = activation_bytes(job(strategy="fsdp"), SMALL)
    bf16 = activation_bytes(job(strategy="fsdp", mixed_precision="bf16"), SMALL)
    tokens = micro_batch_tokens(job())
    # float32 whatever the compute dtype: the norms' inputs and the log-sum-exps
    kept_float32 = 2 * tokens * FLOAT32_PER_TOKEN + tokens * 4 * (8 + 1)
    # the transient: in float32 a layer's backward working set (h + 2 I a token), more than the head's chunk; in
    # bfloat16 that halves below the head's chunk, which stays float32
    fp32_working, head = tokens * (8 + 2 * 16) * 4, head_chunk_bytes(job(), SMALL)
    assert fp32_working > head > fp32_working // 2
    assert bf16 - kept_float32 - head == (fp32 - kept_float32 - fp32_working) // 2


def test_each_stage_computes_in_its_own_dtype():
    """(rollout, training, reference): the engine's dtype, FSDP mixed precision's compute dtype, the
    reference's model.dtype; vLLM on CPU in float32."""
    assert compute_dtypes(job()) == ("float32", "float32", "float32")
    assert compute_dtypes(job(strategy="fsdp", mixed_precision="bf16")) == ("float32", "bfloat16", "float32")
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["model"]["dtype"] = "bfloat16"
    data["rollout"] = {**data.get("rollout", {}), "dtype": "float16"}
    assert compute_dtypes(parse_job_config(data)) == ("float16", "bfloat16", "bfloat16")
    assert compute_dtypes(job(lora={"rank": 4})) == ("float32", "float32", "float32")
    cpu = parse_job_config({**data, "resources": {**data["resources"], "device": "cpu"}, "rollout": {}})
    assert compute_dtypes(cpu)[0] == "float32"  # vLLM's CPU engine, whatever model.dtype says
    assert compute_dtypes(job(strategy="fsdp", mixed_precision="fp16"))[1] == "float16"


def test_a_token_budget_bounds_a_pass_but_never_below_one_sequence():
    sequence = job().algorithm.max_prompt_length + job().algorithm.max_response_length
    rows = activation_bytes(job(micro_batch_size=4), SMALL)
    assert activation_bytes(job(micro_batch_size=4, micro_batch_tokens=4 * sequence), SMALL) == rows
    assert activation_bytes(job(micro_batch_size=4, micro_batch_tokens=2 * sequence), SMALL) == activation_bytes(
        job(micro_batch_size=2), SMALL
    )
    assert activation_bytes(job(micro_batch_size=4, micro_batch_tokens=1), SMALL) == activation_bytes(
        job(micro_batch_size=1), SMALL
    )


def test_the_planner_counts_the_heads_chunk_size():
    from rldock.runtime.engines.head_logprobs import CHUNK_BYTES

    assert LOGIT_CHUNK_BYTES == CHUNK_BYTES
    qwen = PRESETS["qwen2.5-7b"]  # V = 152,064: 55 positions per 32 MiB chunk
    assert head_chunk_bytes(job(), qwen) == 3 * 55 * qwen.vocab_size * 4 <= 3 * CHUNK_BYTES


def test_phases_allgather_swap_and_offload_move_the_state_to_the_host():
    memory = 64 * GIB
    naive = plan_memory(job(strategy="fsdp"), SMALL, device_memory=memory)
    assert naive.generation.training_state == naive.update.training_state > 0
    swapped = plan_memory(job(strategy="fsdp", resharding="allgather_swap"), SMALL, device_memory=memory)
    assert swapped.generation.training_state == 0 and swapped.generation.host == swapped.update.training_state
    offloaded = plan_memory(job(strategy="fsdp", fsdp_cpu_offload=True), SMALL, device_memory=memory)
    engine_weights = SMALL.num_params * 4  # offloaded by the engine's level-1 sleep during the update
    assert offloaded.update.training_state == 0
    assert offloaded.update.host == naive.update.training_state + engine_weights


def test_engine_takes_its_memory_share_and_keeps_the_rest_as_kv_cache():
    cfg = job()
    plan = plan_memory(cfg, SMALL, device_memory=64 * GIB)
    weights = SMALL.num_params * 4
    assert plan.generation.generation_weights == weights
    assert plan.generation.kv_cache == int(cfg.rollout.gpu_memory_utilization * 64 * GIB) - weights
    assert plan.kv_cache_tokens == plan.generation.kv_cache // SMALL.kv_bytes_per_token(4)


def _with(cfg, section: str, **changes):
    return cfg.model_copy(update={section: getattr(cfg, section).model_copy(update=changes)})


@pytest.mark.parametrize(("level", "host_weights"), [(1, True), (2, False)])
def test_the_engine_sleeps_through_the_update_on_an_accelerator(level, host_weights):
    cfg = _with(job(), "rollout", sleep_level=level)
    plan = plan_memory(cfg, SMALL, device_memory=64 * GIB)
    weights, state = SMALL.num_params * 4, plan.update.training_state
    assert plan.engine_sleeps
    assert (plan.update.generation_weights, plan.update.kv_cache) == (0, 0)  # KV cache freed, weights moved
    assert plan.update.host == (weights if host_weights else 0)  # level 1: host copy; level 2: discarded
    assert plan.weight_push == state + weights  # woken weights beside the state, KV cache still freed
    assert plan.generation.generation_weights == weights and plan.generation.kv_cache > 0
    assert plan.peak == max(plan.update.device_total, plan.generation.device_total, plan.weight_push)


def test_on_cpu_the_engine_keeps_its_weights_and_cache_through_the_update():
    cfg = _with(job(), "resources", device="cpu")
    plan = plan_memory(cfg, SMALL, device_memory=64 * GIB)
    # rollout.cpu_kv_cache_gib unset: 256 sequences of one 128-token block and vLLM's null block, 2 * 2 * 1 * 4 * 4
    # bytes a token
    weights, kv_cache = SMALL.num_params * 4, (256 + 1) * 128 * 64
    assert not plan.engine_sleeps
    assert (plan.update.generation_weights, plan.update.kv_cache, plan.update.host) == (weights, kv_cache, 0)
    assert plan.weight_push == plan.update.training_state + weights + kv_cache


def test_the_weight_push_can_be_the_peak():
    # No activations to speak of and a swap: the push (state + woken weights) outgrows both phases.
    cfg = _with(
        job(resharding="allgather_swap", micro_batch_size=1), "algorithm", max_prompt_length=1, max_response_length=1
    )
    plan = plan_memory(cfg, SMALL, device_memory=SMALL.num_params * 4 * 8)  # the engine gets half: 4x its weights
    assert plan.weight_push > max(plan.update.device_total, plan.generation.device_total)
    assert plan.peak == plan.weight_push


def test_paper_7b_fits_64gib_with_fsdp_and_ddp_is_refused_naming_a_field():
    cfg = parse_job_config(yaml.safe_load((EXAMPLES / "grpo-qwen2.5-7b-paper.yaml").read_text()))
    shape = PRESETS["qwen2.5-7b"]
    assert check_fit(cfg, shape, device_memory=64 * GIB).fits
    ddp = cfg.model_copy(
        update={"training": cfg.training.model_copy(update={"strategy": "ddp", "mixed_precision": "none"})}
    )
    verdict = check_fit(ddp, shape, device_memory=128 * GIB)  # fsdp alone fits 128 GiB
    assert not verdict.fits and verdict.field == "training.strategy"
    # With the engine asleep through the update, FSDP over the example's 16 ranks fits 64 GiB too.
    verdict = check_fit(ddp, shape, device_memory=64 * GIB)
    assert not verdict.fits and verdict.field == "training.strategy"
    two_ranks = _with(_with(ddp, "training", data_parallel_size=2), "rollout", gpu_memory_utilization=0.9)
    verdict = check_fit(two_ranks, shape, device_memory=40 * GIB)  # on 40 GiB only more ranks do
    assert not verdict.fits and verdict.field == "training.data_parallel_size" and ">= 16" in verdict.message


def test_refusal_names_the_first_single_change_that_fits():
    cfg = parse_job_config(yaml.safe_load((EXAMPLES / "grpo-qwen2.5-7b-paper.yaml").read_text()))
    no_checkpointing = cfg.model_copy(
        update={"training": cfg.training.model_copy(update={"gradient_checkpointing": False})}
    )
    # 62.6 GiB in the update without checkpointing (the LM head's logits bounded by its chunks)
    plan = plan_memory(no_checkpointing, PRESETS["qwen2.5-7b"], device_memory=60 * GIB)
    assert plan.peak > 60 * GIB
    verdict = check_fit(no_checkpointing, PRESETS["qwen2.5-7b"], device_memory=60 * GIB)
    assert verdict.field == "training.gradient_checkpointing"


@pytest.mark.parametrize("memory,field", [(64, "rollout.tensor_parallel_size"), (128, "rollout.dtype")])
def test_32b_replica_does_not_fit_one_device_in_float32(memory, field):
    cfg = parse_job_config(_paper_32b_in_float32_at_generation_tp_1())
    verdict = check_fit(cfg, PRESETS["qwen2.5-32b"], device_memory=memory * GIB)
    assert not verdict.fits and verdict.field == field


def test_a_model_path_under_home_is_expanded(tmp_path, monkeypatch, capsys):
    # model.path as the examples write it (~/.cache/...): `rldock plan` loads the config as the
    # trainer does, `~` expanded by the loader (config/paths.py).
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "model").mkdir()
    smollm2 = {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "tie_word_embeddings": True,
    }
    (tmp_path / "model" / "config.json").write_text(json.dumps(smollm2))
    example = EXAMPLES / "grpo-smollm2-math.yaml"
    assert main(["plan", str(example), "--json", "--set", "model.path=~/model"]) == 0
    assert json.loads(capsys.readouterr().out)["num_params"] == 134_515_008


def _paper_32b_in_float32_at_generation_tp_1() -> dict:
    """The 32B example before the two changes that make it fit a 64 GB device (docs/scaling.md)."""
    data = yaml.safe_load((EXAMPLES / "grpo-qwen2.5-32b-paper.yaml").read_text())
    data["model"]["dtype"] = "float32"
    data["training"]["mixed_precision"] = "bf16"
    data["rollout"]["tensor_parallel_size"] = 1
    return data


def test_generation_tp_splits_the_engine_weights_over_its_devices():
    data = _paper_32b_in_float32_at_generation_tp_1()
    whole = plan_memory(parse_job_config(data), PRESETS["qwen2.5-32b"], device_memory=64 * GIB)
    data.setdefault("rollout", {})["tensor_parallel_size"] = 4
    split = plan_memory(parse_job_config(data), PRESETS["qwen2.5-32b"], device_memory=64 * GIB)
    assert split.generation.generation_weights == whole.generation.generation_weights // 4
    assert split.update.params == whole.update.params  # training is unchanged


def ppo_job(*, kl_coef: float = 0.01, placement: str = "colocated", **training):
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["training"].update(training)
    data["algorithm"].update(name="ppo", kl_coef=kl_coef)
    data["resources"].update(device="npu", devices_per_node=16, placement=placement)
    return parse_job_config(data)


def test_the_critic_is_the_policy_body_with_a_value_head():
    assert critic_params(SMALL) == SMALL.num_params + 8 + 1  # tied: the embedding is the body's
    untied = dataclasses.replace(SMALL, tie_word_embeddings=False)
    assert critic_params(untied) == untied.num_params - 10 * 8 + 8 + 1  # the LM head dropped


def test_a_critic_rank_holds_a_full_replica_and_its_activations():
    cfg = ppo_job(micro_batch_size=2, data_parallel_size=2)
    critic = plan_memory(cfg, SMALL, device_memory=64 * GIB).critic
    params = critic_params(SMALL) * 4
    tokens = 2 * (cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length)
    per_layer = tokens * ((4 * 8 + (2 + 2) * 4 + 2 * 4 + 4 * 16) * 4 + FLOAT32_PER_TOKEN)  # as the actor's, at TP 1
    working = tokens * (8 + 2 * 16) * 4  # a layer's backward working set: the residual's and the MLP's gradients
    activations = 2 * per_layer + final_norm(tokens) + tokens * 4 + working  # and the layers', final norm's, values
    assert critic.update == PhaseBytes(params, params, 2 * params, activations=activations)
    assert critic.generation == PhaseBytes(params, params, 2 * params)  # never swapped
    assert plan_memory(job(), SMALL, device_memory=64 * GIB).critic is None  # GRPO has none


@pytest.mark.parametrize(
    ("cfg", "beside"),
    [
        (ppo_job(data_parallel_size=2), False),  # actor and reference fill devices 0, 1: critics open 2, 3
        (ppo_job(data_parallel_size=2, kl_coef=0.0), True),  # no reference: critic r beside actor r
        (ppo_job(data_parallel_size=2, tensor_parallel_size=2), True),  # the TP actor devices' free halves
        (ppo_job(data_parallel_size=2, tensor_parallel_size=2, placement="separate"), False),
    ],
)
def test_where_the_critic_sits_matches_the_jobs_placement(cfg, beside):
    from rldock.runtime.flow.job_recipe import job_recipe
    from rldock.runtime.workers.cluster import job_placement

    plan = job_placement(cfg, job_recipe(cfg))  # what the trainer reserves
    assert any(seat.bundle < len(plan.actors) for seat in plan.group("critic")) is beside
    assert plan_memory(cfg, SMALL, device_memory=64 * GIB).critic.beside_actor is beside


def test_a_critic_beside_an_actor_rank_adds_to_that_device():
    alone = plan_memory(ppo_job(data_parallel_size=2), SMALL, device_memory=64 * GIB)
    beside = plan_memory(ppo_job(data_parallel_size=2, kl_coef=0.0), SMALL, device_memory=64 * GIB)
    assert alone.peak == max(alone.actor_peak, alone.critic.peak)
    assert beside.peak == max(
        beside.update.device_total + beside.critic.update.device_total,
        beside.generation.device_total + beside.critic.generation.device_total,
        beside.weight_push + beside.critic.update.device_total,
    )
    assert beside.peak > beside.actor_peak


def test_an_fsdp_critic_shards_its_state_over_the_dp_ranks():
    # grpo-tiny: 128 samples per iteration, 1 update: a mini-batch of 64 per rank at DP 2.
    whole = plan_memory(ppo_job(micro_batch_size=64, data_parallel_size=2), SMALL, device_memory=64 * GIB).critic
    cfg = ppo_job(micro_batch_size=64, data_parallel_size=2, strategy="fsdp")
    assert cfg.num_samples_per_iteration // 2 // cfg.algorithm.num_updates_per_iteration == 64
    critic = plan_memory(cfg, SMALL, device_memory=64 * GIB).critic
    params = critic_params(SMALL) * 4
    half = -(-params // 2)
    gathered = (2 * SMALL.layer_params + 10 * 8) * 4  # two layers and the root's embedding, float32
    # One micro-batch per mini-batch: gradients are reduce-scattered at once, sharded like the params.
    assert critic.update == PhaseBytes(half, half, params, fsdp_gathered=gathered, activations=whole.update.activations)
    assert critic.generation == PhaseBytes(half, half, params)
    # Two micro-batches: the first backward's gradients stay whole (no sync) until the step.
    accumulating = plan_memory(
        ppo_job(micro_batch_size=2, data_parallel_size=2, strategy="fsdp"), SMALL, device_memory=64 * GIB
    ).critic
    assert accumulating.update.grads == params and accumulating.generation.grads == half
    # Offload: the shards on the host, only accumulated whole gradients on the device.
    offloaded = plan_memory(
        ppo_job(micro_batch_size=2, data_parallel_size=2, strategy="fsdp", fsdp_cpu_offload=True),
        SMALL,
        device_memory=64 * GIB,
    ).critic
    assert offloaded.update.training_state == params and offloaded.generation.training_state == 0
    assert offloaded.update.host == offloaded.generation.host == half + half + params
    # A lone FSDP rank shards nothing: the critic trains the bare model, a full replica.
    lone = ppo_job(micro_batch_size=64, data_parallel_size=1, strategy="fsdp")
    replica = ppo_job(micro_batch_size=64, data_parallel_size=1)
    assert (
        plan_memory(lone, SMALL, device_memory=64 * GIB).critic
        == plan_memory(replica, SMALL, device_memory=64 * GIB).critic
    )


def test_gradient_checkpointing_and_mixed_precision_shrink_an_fsdp_critics_activations():
    plain = plan_memory(
        ppo_job(micro_batch_size=2, data_parallel_size=2, strategy="fsdp"), SMALL, device_memory=64 * GIB
    ).critic.update
    bf16 = plan_memory(
        ppo_job(micro_batch_size=2, data_parallel_size=2, strategy="fsdp", mixed_precision="bf16"),
        SMALL,
        device_memory=64 * GIB,
    ).critic.update
    tokens = 2 * (8 + 6)  # micro_batch_size x (max_prompt_length + max_response_length)
    values = tokens * 4
    # the values, the norms' float32 inputs and roots (the final norm's too), the log-sum-exps
    kept_float32 = values + 2 * tokens * FLOAT32_PER_TOKEN + tokens * 4 * (8 + 1)
    assert bf16.activations - kept_float32 == (plain.activations - kept_float32) // 2
    assert bf16.fsdp_gathered == plain.fsdp_gathered // 2 and bf16.params == plain.params  # float32 masters
    checkpointed = plan_memory(
        ppo_job(micro_batch_size=2, data_parallel_size=2, strategy="fsdp", gradient_checkpointing=True),
        SMALL,
        device_memory=64 * GIB,
    ).critic.update
    working = tokens * (8 + 2 * 16) * 4  # a layer's backward working set, in the compute dtype (halved in bf16 above)
    per_layer = (plain.activations - values - final_norm(tokens) - working) // 2
    assert checkpointed.activations == 2 * tokens * 8 * 4 + per_layer + final_norm(tokens) + values + working


def test_a_7b_critic_fits_a_64gb_device_once_sharded():
    shape = PRESETS["qwen2.5-7b"]
    ddp = ppo_job(data_parallel_size=8, resharding="allgather_swap", micro_batch_size=1)
    assert plan_critic(ddp, shape).peak > 64 * GIB  # 16 bytes per parameter: about 105 GiB
    fsdp = ppo_job(data_parallel_size=8, strategy="fsdp", resharding="allgather_swap", micro_batch_size=1)
    assert plan_critic(fsdp, shape).peak < 64 * GIB  # about 40 GiB, 26.3 of it whole accumulated gradients


def test_a_critic_too_big_for_its_device_is_refused_naming_a_field():
    shape = PRESETS["qwen2.5-7b"]
    cfg = ppo_job(data_parallel_size=2, resharding="allgather_swap", micro_batch_size=1)
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"gpu_memory_utilization": 0.9})})
    verdict = check_fit(cfg, shape, device_memory=64 * GIB)  # float32 critic: 4 x 26.4 GiB of state
    assert not verdict.fits and verdict.field == "model.dtype" and "critic rank" in verdict.message
    verdict = check_fit(cfg, shape, device_memory=32 * GIB)  # even in bfloat16 (52.8 GiB) it does not fit
    assert not verdict.fits and verdict.field == "resources.device_memory_gib" and "not sharded" in verdict.message


def test_rollout_dtype_sizes_the_engine_apart_from_the_training_master():
    master = job()  # grpo-tiny: model.dtype float32, here on an accelerator
    bf16_engine = master.model_copy(update={"rollout": master.rollout.model_copy(update={"dtype": "bfloat16"})})
    shape = PRESETS["qwen2.5-7b"]
    before, after = (plan_memory(cfg, shape, device_memory=64 * GIB) for cfg in (master, bf16_engine))
    assert after.generation.generation_weights * 2 == before.generation.generation_weights
    assert after.update.params == before.update.params  # training keeps its float32 weights
    assert after.kv_cache_tokens > 2 * before.kv_cache_tokens  # more cache left, at half the bytes a token
