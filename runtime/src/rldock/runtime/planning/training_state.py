"""An actor rank's training state (params, gradients, AdamW's moments) and what FSDP adds beside it in
the update (whole gradients, gathered weights), by TP, FSDP's shards and, under PP, the heaviest stage
(the formulas: planning/memory.py's module docstring; planning/memory.py re-exports these)."""

from __future__ import annotations

from rldock.config import JobConfig
from rldock.config.job_layout import job_layout
from rldock.runtime.planning.dtypes import DTYPE_BYTES, compute_element_bytes
from rldock.runtime.planning.pipeline_stages import stage_layers, stage_vocab_params
from rldock.runtime.planning.shapes import ModelShape


def fsdp_shard_ranks(cfg: JobConfig) -> int:
    """The ranks FSDP shards a tensor over: the DP x CP sequence ranks (training/context_parallel.py), those
    of one replica under HSDP (training.data_parallel_replicate_size); under PP, those of one stage."""
    return job_layout(cfg).num_sequence_ranks // cfg.training.data_parallel_replicate_size


def layer_params_per_tp_rank(shape: ModelShape, *, tp: int, ep: int = 1, dense: bool = False) -> int:
    """One decoder layer's parameters on a TP rank, the model's largest (an MoE layer's in an MoE model; `dense`:
    a layer with a dense MLP, such as DeepSeek-V3's first three): TP's plan (rldock.contract.tensor_parallel)
    splits the attention's linears (their biases with them) and a dense MLP's; the two RMSNorms and what the
    attention keeps whole (Qwen3's per-head q and k norms; MLA's down projections and their norms,
    planning/attention_shapes.py) stay whole on every TP rank, as do an MoE layer's router and experts (its
    plan splits the attention only), of which EP leaves a rank 1/ep (`ep`: 1 for the experts' training state,
    which FSDP shards over ep x dp/ep ranks anyway)."""
    moe = shape.is_moe and not dense
    whole = 2 * shape.hidden_size + shape.attention.tp_whole_params(shape.hidden_size)
    whole_mlp = shape.mlp_params if moe else 0  # the router and the experts
    split = (shape.layer_params if moe else shape.dense_layer_params) - whole - whole_mlp
    experts = shape.expert_params if moe else 0
    return split // tp + whole + whole_mlp - experts + experts // ep


def layers_params_per_tp_rank(shape: ModelShape, layers: range, *, tp: int) -> int:
    """The decoder layers `layers`' parameters on a TP rank (`layer_params_per_tp_rank`, dense and MoE apart)."""
    moe = shape.moe_layers_in(layers)
    per_moe, per_dense = layer_params_per_tp_rank(shape, tp=tp), layer_params_per_tp_rank(shape, tp=tp, dense=True)
    return moe * per_moe + (len(layers) - moe) * per_dense


def stage_training_state_bytes(cfg: JobConfig, shape: ModelShape, stage: int) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes one actor rank of pipeline stage `stage` holds (0 without PP):
    its layers' weights (TP splits their linears, not the norms nor an MoE layer's router and experts:
    `layer_params_per_tp_rank`; an MoE model's dense layers apart), the vocabulary matrices it holds
    (planning/pipeline_stages.py) and, on the last stage, the final norm; FSDP divides all three by its
    shard ranks. Beside EP under HSDP the routed experts are not replicated: an EP group splits them and FSDP
    shards a rank's over its expert-data-parallel ranks, which span the replicas (resharding/parallel_mesh.py's
    `edp`), so they divide by every replica's ranks, the other weights by one replica's."""
    training = cfg.training
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    tp, stages = training.tensor_parallel_size, training.pipeline_parallel_size
    shard = fsdp_shard_ranks(cfg) if training.strategy == "fsdp" else 1
    vocab = stage_vocab_params(shape, stage=stage, stages=stages)
    run = stage_layers(shape.num_layers, stage=stage, stages=stages)
    layers = layers_params_per_tp_rank(shape, run, tp=tp)
    params = vocab + layers + (shape.hidden_size if stage == stages - 1 else 0)
    trainable = params - (vocab if training.freeze_embeddings else 0)
    spanning = training.strategy == "fsdp" and training.expert_parallel_size > 1
    experts = shape.moe_layers_in(run) * shape.expert_params if spanning else 0
    expert_shard = shard * training.data_parallel_replicate_size

    def per_rank(count: int, copies: int = 1) -> int:  # `copies`: AdamW's two moments
        dense = -(-copies * (count - experts) * param_bytes // shard)
        return dense + -(-copies * experts * param_bytes // expert_shard)

    return per_rank(params), per_rank(trainable), per_rank(trainable, copies=2)


def training_state_bytes(cfg: JobConfig, shape: ModelShape) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes one actor rank holds: under PP the heaviest stage's (the
    most bytes of the three together)."""
    stages = range(cfg.training.pipeline_parallel_size)
    return max((stage_training_state_bytes(cfg, shape, stage) for stage in stages), key=sum)


def fsdp_whole_gradient_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """The gradient bytes an FSDP rank holds whole during the backward, beyond the shards that
    `training_state_bytes` counts (planning/memory.py's module docstring): the LM head's whole gradient
    in the compute dtype in place of its shard (none with training.freeze_embeddings; under PP the last
    stage's, as much as stage 0's embedding), plus one layer's reduce-scatter input (its whole gradient
    in the reduce dtype; a TP rank's slice of it under TP, the layer's own experts under EP, as
    `fsdp_gathered_bytes` counts them), on the
    device with training.fsdp_cpu_offload too. 0 without FSDP."""
    training = cfg.training
    if training.strategy != "fsdp":
        return 0
    param_bytes = DTYPE_BYTES[cfg.model.dtype]  # FSDP reduces in float32 under mixed precision: the shards' dtype
    compute = compute_element_bytes(cfg)
    shard = fsdp_shard_ranks(cfg)
    head = 0 if training.freeze_embeddings else shape.vocab_size * shape.hidden_size
    layer = layer_params_per_tp_rank(shape, tp=training.tensor_parallel_size, ep=training.expert_parallel_size)
    # the head's shard, counted in the device's gradients unless they live on the host (fsdp_cpu_offload)
    head_shard = 0 if training.fsdp_cpu_offload else -(-head * param_bytes // shard)
    return head * compute - head_shard + layer * param_bytes


def fsdp_gathered_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """The weights an FSDP rank holds gathered in the compute dtype during the update: two layers (the
    computing one and the prefetched next; under TP the rank's slices, which FSDP gathers over the
    data-parallel ranks only; under EP a layer's own E/ep experts, gathered over the expert-data-parallel
    group only) and the root's vocabulary matrices (the embedding and an untied
    head; under PP the most one stage holds, V x h). 0 without FSDP."""
    training = cfg.training
    if training.strategy != "fsdp":
        return 0
    stages = training.pipeline_parallel_size
    layer = layer_params_per_tp_rank(shape, tp=training.tensor_parallel_size, ep=training.expert_parallel_size)
    root = max(stage_vocab_params(shape, stage=stage, stages=stages) for stage in range(stages))
    return (2 * layer + root) * compute_element_bytes(cfg)
