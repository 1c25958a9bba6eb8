"""The memory planner under pipeline parallelism (training.pipeline_parallel_size, planning/pipeline_stages.py):
the heaviest stage's training state, stage 0's activations of min(p, m) micro-batches, the 1F1B bubble
in the plan, its table and its JSON, and p = 1 as without PP."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.runtime.planning import PRESETS, ModelShape, check_fit, plan_memory
from rldock.runtime.planning.memory import (
    GIB,
    activation_bytes,
    backward_working_bytes,
    final_norm_bytes,
    fsdp_gathered_bytes,
    head_chunk_bytes,
    stage_activation_bytes,
    stage_output_bytes,
    stage_saved_bytes,
    stage_training_state_bytes,
    stage_working_bytes,
    training_state_bytes,
    update_micro_batches,
)
from rldock.runtime.planning.pipeline_stages import pipeline_bubble, stage_layer_counts, stage_vocab_params
from rldock.runtime.planning.report import plan_json, plan_table

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
# 4 layers (two a stage at PP 2, one at PP 4), hidden 8, 2 heads of 4, 1 KV head, MLP 16, vocab 10: 592 per layer.
UNTIED = ModelShape(
    "small",
    vocab_size=10,
    hidden_size=8,
    num_layers=4,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    tie_word_embeddings=False,
)
TIED = dataclasses.replace(UNTIED, tie_word_embeddings=True)
LAYER, MATRIX, NORM = 592, 10 * 8, 8  # a layer's, a vocabulary matrix's and the final norm's parameters


def job(**training):
    """grpo-tiny under FSDP: 128 samples an iteration over DP 2, so a mini-batch of 64 rows of 14 tokens."""
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["training"].update({"strategy": "fsdp", **training})
    data["resources"].update(device="npu", devices_per_node=8)
    return parse_job_config(data)


@pytest.mark.parametrize(("layers", "stages"), [(4, 1), (4, 2), (4, 4), (5, 2), (28, 8), (30, 4)])
def test_the_planner_splits_the_layers_as_the_runtime_does(layers, stages):
    from rldock.runtime.models.pipeline_stage import stage_layers

    assert stage_layer_counts(layers, stages) == [len(run) for run in stage_layers(layers, stages)]


def test_stages_hold_the_embedding_first_and_the_head_last():
    assert [stage_vocab_params(UNTIED, stage=s, stages=1) for s in range(1)] == [2 * MATRIX]
    assert [stage_vocab_params(TIED, stage=s, stages=1) for s in range(1)] == [MATRIX]
    # under PP a tied model's last stage holds a copy of the embedding as its head
    for shape in (UNTIED, TIED):
        assert [stage_vocab_params(shape, stage=s, stages=2) for s in range(2)] == [MATRIX, MATRIX]
        assert [stage_vocab_params(shape, stage=s, stages=4) for s in range(4)] == [MATRIX, 0, 0, MATRIX]


@pytest.mark.parametrize("shape", [UNTIED, TIED])
def test_pp_2_halves_the_layers_training_state_within_the_vocabulary_share(shape):
    """Float32, FSDP over DP 2 either way: the heaviest stage (the last: two layers, the head, the final norm)
    holds half the layers; what is left over the half is the head (untied: half of the two matrices) or the
    tied model's copy of the embedding, and the final norm."""
    whole = training_state_bytes(job(), shape)
    staged = training_state_bytes(job(pipeline_parallel_size=2), shape)
    assert staged == stage_training_state_bytes(job(pipeline_parallel_size=2), shape, 1)
    assert staged[0] == (2 * LAYER + MATRIX + NORM) * 4 // 2
    extra = (MATRIX if shape.tie_word_embeddings else 0) + NORM  # beyond half the whole model's
    for one, half in zip(whole, staged):
        assert 2 * half - one == extra * 4 * (one // whole[0]) // 2  # params, grads, and AdamW's two moments
    assert sum(staged) < 0.6 * sum(whole)


def test_the_heaviest_stage_is_counted_whichever_it_is():
    five = dataclasses.replace(UNTIED, num_layers=5)  # PP 2: stage 0 three layers and the embedding
    cfg = job(pipeline_parallel_size=2)
    first, last = (stage_training_state_bytes(cfg, five, s) for s in range(2))
    assert first[0] == (3 * LAYER + MATRIX) * 4 // 2 and last[0] == (2 * LAYER + MATRIX + NORM) * 4 // 2
    assert training_state_bytes(cfg, five) == first
    # frozen vocabulary matrices: no gradients or moments for them on either stage
    frozen = stage_training_state_bytes(job(pipeline_parallel_size=2, freeze_embeddings=True), five, 1)
    assert frozen[1] == (2 * LAYER + NORM) * 4 // 2 and frozen[2] == 2 * frozen[1]
    # TP splits the linears of each stage's layers; a layer's two norms (2 x 8) stay whole on each TP rank
    tp = stage_training_state_bytes(job(pipeline_parallel_size=2, tensor_parallel_size=2), five, 1)
    assert tp[0] == (2 * ((LAYER - 16) // 2 + 16) + MATRIX + NORM) * 4 // 2


def test_a_stage_gathers_one_vocabulary_matrix_as_its_root():
    assert fsdp_gathered_bytes(job(), UNTIED) == (2 * LAYER + 2 * MATRIX) * 4
    assert fsdp_gathered_bytes(job(pipeline_parallel_size=2), UNTIED) == (2 * LAYER + MATRIX) * 4
    assert fsdp_gathered_bytes(job(pipeline_parallel_size=2), TIED) == (2 * LAYER + MATRIX) * 4


@pytest.mark.parametrize(
    ("stages", "micro_batch_size", "micro_batches"),
    [(2, 64, 1), (2, 32, 2), (2, 8, 8), (4, 32, 2), (4, 8, 8)],
)
def test_stage_0_holds_min_p_m_micro_batches_of_its_layers(stages, micro_batch_size, micro_batches):
    """Without checkpointing and CP (no mask), what autograd keeps on stage 0 is min(p, m) x its layer share of
    one micro-batch's decoder activations at p = 1 (the whole figure less the final norm's and the LM head's
    chunk, which are the last stage's); beside it, its held outputs and a layer's backward working set."""
    flat = job(micro_batch_size=micro_batch_size)
    piped = job(micro_batch_size=micro_batch_size, pipeline_parallel_size=stages)
    assert update_micro_batches(piped) == micro_batches
    last_only = final_norm_bytes(flat, UNTIED, element=4) + stage_working_bytes(flat, UNTIED, 0)
    one_micro_batch = activation_bytes(flat, UNTIED) - last_only
    layers = stage_layer_counts(UNTIED.num_layers, stages)[0]  # every stage's here: 4 layers split evenly
    share_of_one = layers * one_micro_batch // UNTIED.num_layers
    held = min(stages, micro_batches)
    assert stage_saved_bytes(piped, UNTIED, 0) == held * share_of_one
    besides = stage_output_bytes(piped, UNTIED, 0) + backward_working_bytes(piped, UNTIED, element=4, tp=1)
    assert stage_activation_bytes(piped, UNTIED, 0) == held * share_of_one + besides
    # the last stage holds one micro-batch of its layers, the final norm's and the head's chunk
    assert stage_activation_bytes(piped, UNTIED, stages - 1) == share_of_one + last_only
    fullest = max(stage_activation_bytes(piped, UNTIED, s) for s in range(stages))
    assert activation_bytes(piped, UNTIED) == fullest == plan_memory(piped, UNTIED).update.activations


def test_checkpointed_stages_keep_each_held_micro_batchs_layer_inputs_and_recompute_one_layer():
    flat = job(micro_batch_size=8, gradient_checkpointing=True)
    piped = job(micro_batch_size=8, gradient_checkpointing=True, pipeline_parallel_size=2)
    tokens, element = 8 * 14, 4
    inputs = UNTIED.num_layers * tokens * UNTIED.hidden_size * element  # every layer's input, one micro-batch
    last_only = final_norm_bytes(flat, UNTIED, element=element) + stage_working_bytes(flat, UNTIED, 0)
    recomputed = activation_bytes(flat, UNTIED) - last_only - inputs
    assert stage_saved_bytes(piped, UNTIED, 0) == 2 * inputs // 2 + recomputed  # 2 held, half the layers
    besides = stage_output_bytes(piped, UNTIED, 0) + stage_working_bytes(piped, UNTIED, 0)
    assert stage_activation_bytes(piped, UNTIED, 0) == 2 * inputs // 2 + recomputed + besides


def test_a_stage_before_the_last_keeps_its_outputs_and_a_layers_backward_working_set():
    """Stage 0 of PP 2 at 8 rows of 14 tokens a micro-batch (112 tokens in float32; 8 micro-batches, 1F1B
    holding 2 there): the peak measured there (docs/scaling.md, section 12) is in its last layer's MLP backward,
    where the residual stream's gradient (T, h) and the gradients of the down projection's input, the
    activation and the up projection (3 x (T, I)) are live and the down projection's input (T, I) is freed."""
    cfg = job(micro_batch_size=8, pipeline_parallel_size=2)
    tokens, h, intermediate = 8 * 14, 8, 16
    assert backward_working_bytes(cfg, UNTIED, element=4, tp=1) == tokens * (h + 3 * intermediate - intermediate) * 4
    assert backward_working_bytes(cfg, UNTIED, element=4, tp=1) == 17_920
    # TP splits the MLP's gradients, not the residual stream's; bfloat16 halves every element
    assert backward_working_bytes(cfg, UNTIED, element=2, tp=2) == tokens * (h + 2 * intermediate // 2) * 2 == 5_376
    # a CP rank's positions: half of them at CP 2
    cp = job(micro_batch_size=8, pipeline_parallel_size=2, context_parallel_size=2, data_parallel_size=1)
    assert backward_working_bytes(cp, UNTIED, element=4, tp=1) == tokens // 2 * (h + 2 * intermediate) * 4 == 8_960
    # the outputs of the two micro-batches it holds, each (T, h), which the schedule keeps for their backward
    assert stage_output_bytes(cfg, UNTIED, 0) == 2 * tokens * h * 4 == 7_168
    assert stage_working_bytes(cfg, UNTIED, 0) == 17_920
    # the last stage's output is the final norm's input (counted there); its transient is the larger of the LM
    # head's chunk, 3 x T x V float32, and a layer's backward working set: here (V 10) the working set
    assert stage_output_bytes(cfg, UNTIED, 1) == 0
    assert head_chunk_bytes(cfg, UNTIED) == 3 * tokens * 10 * 4 < 17_920
    assert stage_working_bytes(cfg, UNTIED, 1) == 17_920
    wide = dataclasses.replace(UNTIED, vocab_size=1000)  # a vocabulary whose head's chunk is the larger
    assert stage_working_bytes(cfg, wide, 1) == head_chunk_bytes(cfg, wide) == 3 * tokens * 1000 * 4
    assert stage_activation_bytes(cfg, UNTIED, 0) == stage_saved_bytes(cfg, UNTIED, 0) + 7_168 + 17_920


@pytest.mark.parametrize(
    ("stages", "micro_batch_size", "bubble"),
    [(1, 8, 0.0), (2, 64, 1 / 2), (2, 32, 1 / 3), (2, 8, 1 / 9), (4, 32, 3 / 5), (4, 8, 3 / 11)],
)
def test_the_plan_states_the_bubble(stages, micro_batch_size, bubble):
    cfg = job(micro_batch_size=micro_batch_size, pipeline_parallel_size=stages)
    plan = plan_memory(cfg, UNTIED, device_memory=64 * GIB)
    m = 64 // micro_batch_size
    assert plan.micro_batches == m and plan.pipeline_parallel_size == stages
    assert plan.pipeline_bubble == pytest.approx(bubble) == pipeline_bubble(stages=stages, micro_batches=m)
    report = plan_json(plan, None)
    assert report["pipeline_bubble"] == plan.pipeline_bubble
    assert (report["pipeline_parallel_size"], report["micro_batches"]) == (stages, m)
    table = plan_table(plan, None)
    if stages == 1:
        assert "pipeline" not in table and "PP" not in table
    else:
        assert f"PP {stages} x DP 2 x TP 1" in table
        assert f"pipeline: {stages} stages, 1F1B over {m} micro-batches" in table
        assert f"(stage 0 holds {min(stages, m)} at once)" in table and f"= {bubble:.3f} of the update step" in table


@pytest.mark.parametrize("shape", [UNTIED, TIED])
def test_at_p_1_the_one_stage_holds_the_whole_model(shape):
    cfg = job(pipeline_parallel_size=1, micro_batch_size=8)
    assert training_state_bytes(cfg, shape) == stage_training_state_bytes(cfg, shape, 0)
    assert stage_training_state_bytes(cfg, shape, 0)[0] == shape.num_params * 4 // 2
    assert activation_bytes(cfg, shape) == stage_activation_bytes(cfg, shape, 0)
    assert fsdp_gathered_bytes(cfg, shape) == (2 * LAYER + shape.embedding_params) * 4
    assert plan_memory(cfg, shape) == plan_memory(job(micro_batch_size=8), shape)  # the default is p = 1
    assert plan_memory(cfg, shape).pipeline_bubble == 0.0


def test_more_stages_than_layers_are_refused_naming_the_field():
    two_layers = dataclasses.replace(UNTIED, num_layers=2)
    verdict = check_fit(job(pipeline_parallel_size=4), two_layers, device_memory=64 * GIB)
    assert not verdict.fits and verdict.field == "training.pipeline_parallel_size"
    assert "at most 2" in verdict.message
    assert check_fit(job(pipeline_parallel_size=2), two_layers, device_memory=64 * GIB).fits


def test_a_pipelined_job_too_long_for_its_device_is_told_the_cp_size_it_needs():
    """CP composes with PP (each stage's CP ranks split the positions), so the verdict's CP search runs under PP."""
    data = yaml.safe_load((EXAMPLES / "grpo-qwen2.5-7b-paper.yaml").read_text())
    data["algorithm"]["max_response_length"] = 131072  # a 133K-token trajectory: CP's case at p = 1
    data["rollout"].update(dtype="bfloat16", gpu_memory_utilization=0.3)
    data["training"]["pipeline_parallel_size"] = 2
    data["resources"]["num_nodes"] = 8
    verdict = check_fit(parse_job_config(data), PRESETS["qwen2.5-7b"], device_memory=48 * GIB)
    assert not verdict.fits and verdict.field == "training.context_parallel_size"
    assert "context_parallel_size >= 2" in verdict.message


def _one_rank_7b(**algorithm):
    """The 7B paper example on one DDP rank of a 64 GiB device, in float32 (docs/scaling.md's first plan)."""
    data = yaml.safe_load((EXAMPLES / "grpo-qwen2.5-7b-paper.yaml").read_text())
    data["training"].update(data_parallel_size=1, strategy="ddp", mixed_precision="none")
    data["resources"].update(num_nodes=1, devices_per_node=2)  # a critic's rank has a device of its own
    data["algorithm"].update(algorithm)
    return parse_job_config(data)


def test_a_job_no_single_setting_fits_is_told_the_pipeline_stages_beside_the_data_parallel_size():
    verdict = check_fit(_one_rank_7b(), PRESETS["qwen2.5-7b"], device_memory=64 * GIB)
    assert not verdict.fits and verdict.field == "training.data_parallel_size"
    assert "training.data_parallel_size >= 4" in verdict.message
    # the fewest stages at which the lean job fits: 2 do not, 4 do (7.6B parameters' state over 4 stages)
    assert "training.pipeline_parallel_size >= 4 at data_parallel_size 1" in verdict.message
    # a critic's job is told stages too, its value model cut into the same ones: 4 on 128 GiB, where the job
    # without a critic needs 2 (the lean job seats a critic rank beside each actor rank, and the two add up)
    ppo = check_fit(_one_rank_7b(name="ppo"), PRESETS["qwen2.5-7b"], device_memory=128 * GIB)
    assert not ppo.fits and ppo.field == "training.data_parallel_size"
    assert "training.pipeline_parallel_size >= 4 at data_parallel_size 1" in ppo.message
    grpo = check_fit(_one_rank_7b(), PRESETS["qwen2.5-7b"], device_memory=128 * GIB)
    assert "training.pipeline_parallel_size >= 2" in grpo.message


def test_the_stages_named_say_the_devices_their_ranks_take_beyond_the_resources():
    """PP 4 at DP 1 is 4 actor ranks, where the job's resources give 2 devices (validate refuses more ranks
    than devices, rldock.config.problems); at 4 devices the words leave the count out."""
    verdict = check_fit(_one_rank_7b(), PRESETS["qwen2.5-7b"], device_memory=64 * GIB)
    assert "at data_parallel_size 1 (4 actor ranks where resources give 2 devices; peak then" in verdict.message
    roomy = _one_rank_7b().model_copy(
        update={"resources": _one_rank_7b().resources.model_copy(update={"devices_per_node": 4})}
    )
    verdict = check_fit(roomy, PRESETS["qwen2.5-7b"], device_memory=64 * GIB)
    assert "at data_parallel_size 1 (peak then" in verdict.message


def test_a_critic_rank_holds_its_fullest_stage_s_value_model():
    """Under PP the critic's value model is cut into the actor's stages (runtime workers/critic.py): the stages'
    parameters add up to the whole value model's, and a critic rank is planned as the fullest stage's, its
    state 1/stages of the whole's or so (7B at PP 2, float32, FSDP over one rank a stage)."""
    from rldock.runtime.planning.memory import DTYPE_BYTES, critic_params, critic_stage_params, plan_critic

    shape = PRESETS["qwen2.5-7b"]
    stages = [critic_stage_params(shape, stage=s, stages=2) for s in range(2)]
    assert sum(stages) == critic_params(shape) == critic_stage_params(shape, stage=0, stages=1)
    cfg = _one_rank_7b(name="ppo")
    staged = cfg.model_copy(
        update={"training": cfg.training.model_copy(update={"strategy": "fsdp", "pipeline_parallel_size": 2})}
    )
    critic = plan_critic(staged, shape)
    assert critic is not None
    assert critic.update.params == max(stages) * DTYPE_BYTES[cfg.model.dtype]
    whole = plan_critic(cfg, shape)
    assert whole is not None and critic.update.params < 0.6 * whole.update.params


def test_a_critic_too_large_for_its_device_is_refused_naming_its_shards_and_stages():
    """The refusal of a critic rank names what the planner divided it by: FSDP's shard ranks (DP x CP; it read
    data_parallel_size alone) and, under PP, its stages."""
    from rldock.runtime.planning.verdict import _critic_refusal

    cfg = _one_rank_7b(name="ppo")
    layout = {"strategy": "fsdp", "context_parallel_size": 2, "pipeline_parallel_size": 2}
    staged = cfg.model_copy(update={"training": cfg.training.model_copy(update=layout)})
    # the refusal check_fit gives when a critic rank alone exceeds its device
    verdict = _critic_refusal(staged, PRESETS["qwen2.5-7b"], peak=200 * GIB, device_memory=8 * GIB)
    assert not verdict.fits
    assert "sharded over 2 FSDP ranks a stage, its fullest of 2 pipeline stages" in verdict.message, verdict.message
