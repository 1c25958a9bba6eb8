"""An MoE model's figures beside the bytes: its parameters, one rank's expert shard, the all-to-all
and the redundant weights of the paper's eq. 3 (planning/memory.py re-exports these)."""

from __future__ import annotations

from dataclasses import dataclass

from rldock.config import JobConfig
from rldock.config.job_layout import job_layout
from rldock.runtime.planning.activations import micro_batch_tokens
from rldock.runtime.planning.dtypes import DTYPE_BYTES, compute_element_bytes
from rldock.runtime.planning.pipeline_stages import stage_layers, stage_vocab_params
from rldock.runtime.planning.shapes import ModelShape
from rldock.runtime.planning.training_state import fsdp_shard_ranks


@dataclass(frozen=True)
class MoePlan:
    """An MoE model's figures beside the bytes: parameters, this rank's expert shard, the all-to-all."""

    num_experts: int
    top_k: int
    active_params: int
    expert_parallel_size: int
    experts_per_rank: int  # each MoE layer's experts one EP rank holds
    expert_bytes_per_rank: int  # their parameter bytes over its stage's MoE layers, before FSDP's 1/(dp/ep)
    all_to_all_bytes: int  # what one rank sends per update micro-batch: dispatch and combine, its stage's MoE layers,
    # forward
    # (a CP rank: its 1/cp of the positions)
    redundant: RedundantWeights


@dataclass(frozen=True)
class RedundantWeights:
    """The paper's eq. 3 with experts: the training weights naive resharding leaves on the devices
    during generation, beside the engine's, counted over the generation replicas (one device each:
    an engine's first rank, `JobLayout.engine_ranks`).

    MindSpeed RL writes R = GDP * (TW/UTP + EW/GEP): GDP generation replicas, TW the weights split
    by tensor parallelism (everything but the experts: attention, embeddings, norms, routers), EW the
    expert weights, UTP the update's TP and GEP the expert split (its update and generation EP are
    one size). `paper_bytes` is that figure with rldock's sizes: UTP training.tensor_parallel_size,
    GEP the generation's expert split, rollout.tensor_parallel_size (vLLM splits experts by its TP;
    rldock runs no engine EP). rldock's training layout splits further, so what its naive resharding
    leaves (`naive_bytes`) is R with the update's own splits: TW over UTP x the FSDP shards, EW over
    training.expert_parallel_size x the expert-data-parallel FSDP shards (every rank holds 1/dp of
    either under FSDP). allgather_swap leaves none: the training state goes to the host.

    Under the update's pipeline parallelism (UPP stages) an update rank holds its stage's layers only, and so
    does an engine's device: both figures sum, over the GDP engine ranks (each replica's first actor rank,
    `JobLayout.engine_ranks`), the TW and EW of that rank's stage (its layers' dense and expert weights, the
    embedding on the first stage, the head and the final norm on the last; stage = rank // the stage's
    dp x cp x tp ranks, PP outermost as in resharding/parallel_mesh.py). With the engine ranks spread evenly
    over the stages that is R = GDP x (TW/(UTP x UPP) + EW/(GEP x UPP)), the paper's eq. 3 with the update's PP
    split, to the layers' uneven split, the vocabulary matrices and an MoE model's first dense layers;
    `dense_weight_bytes` and `expert_weight_bytes` stay the whole model's.
    """

    generation_replicas: int  # GDP
    generation_expert_split: int  # GEP
    dense_weight_bytes: int  # TW
    expert_weight_bytes: int  # EW
    dense_split: int  # the update's split of TW on a device: UTP (x FSDP's shards)
    expert_split: int  # the update's split of EW on a device: EP (x FSDP's expert-data-parallel shards)
    paper_bytes: int  # GDP * (TW/UTP + EW/GEP)
    naive_bytes: int  # GDP * (TW/dense_split + EW/expert_split): training.resharding naive


def plan_redundant_weights(cfg: JobConfig, shape: ModelShape) -> RedundantWeights:
    """Eq. 3 with experts for `cfg` and `shape` (RedundantWeights)."""
    training, layout = cfg.training, job_layout(cfg)
    element = DTYPE_BYTES[cfg.model.dtype]
    experts = shape.num_moe_layers * shape.expert_params * element
    dense = shape.num_params * element - experts
    fsdp = training.strategy == "fsdp"
    dense_split = training.tensor_parallel_size * (fsdp_shard_ranks(cfg) if fsdp else 1)
    expert_split = layout.ep * (layout.expert_data_parallel if fsdp else 1)
    gdp, gep = layout.num_generation_replicas, layout.generation_tp
    stage_ranks = layout.num_actor_ranks // layout.pp
    engine_stages = [_stage_weights(shape, stage=rank // stage_ranks, stages=layout.pp) for rank in layout.engine_ranks]
    return RedundantWeights(
        generation_replicas=gdp,
        generation_expert_split=gep,
        dense_weight_bytes=dense,
        expert_weight_bytes=experts,
        dense_split=dense_split,
        expert_split=expert_split,
        paper_bytes=sum(d * element // training.tensor_parallel_size + e * element // gep for d, e in engine_stages),
        naive_bytes=sum(d * element // dense_split + e * element // expert_split for d, e in engine_stages),
    )


def _stage_weights(shape: ModelShape, *, stage: int, stages: int) -> tuple[int, int]:
    """(TW, EW) parameters of pipeline stage `stage` of `stages`: its layers' dense and expert parameters, its
    vocabulary matrices and, on the last, the final norm (the whole model's at one stage)."""
    layers = stage_layers(shape.num_layers, stage=stage, stages=stages)
    vocab = stage_vocab_params(shape, stage=stage, stages=stages)
    norm = shape.hidden_size if stage == stages - 1 else 0
    expert = shape.moe_layers_in(layers) * shape.expert_params
    return vocab + shape.layers_params(layers) - expert + norm, expert


def plan_moe(cfg: JobConfig, shape: ModelShape) -> MoePlan | None:
    """The MoE figures of `cfg` with `shape`; None for a dense model. The all-to-all moves each of a
    micro-batch's tokens' k copies to their experts and the outputs back (2 x tokens x k x h
    elements per layer), of which the share (ep - 1) / ep leaves the rank when experts are spread
    evenly; the backward moves as much again. Under CP a rank routes its ceil(tokens / cp) positions
    only (EP groups are carved out of the dp x cp ranks, rldock.contract.layout). Under PP a rank holds
    and dispatches for its stage's MoE layers only: the figures count the stage with the most (an MoE model's
    first dense layers hold no experts and dispatch nothing)."""
    if not shape.is_moe:
        return None
    training = cfg.training
    ep, cp = training.expert_parallel_size, training.context_parallel_size
    stages = training.pipeline_parallel_size
    layers = max(shape.moe_layers_in(stage_layers(shape.num_layers, stage=s, stages=stages)) for s in range(stages))
    element = compute_element_bytes(cfg)
    tokens = -(-micro_batch_tokens(cfg) // cp)  # this rank's positions of the micro-batch
    sent = 2 * tokens * shape.num_experts_per_tok * shape.hidden_size * element
    return MoePlan(
        num_experts=shape.num_experts,
        top_k=shape.num_experts_per_tok,
        active_params=shape.active_params,
        expert_parallel_size=ep,
        experts_per_rank=shape.num_experts // ep,
        expert_bytes_per_rank=layers * shape.expert_params // ep * DTYPE_BYTES[cfg.model.dtype],
        all_to_all_bytes=layers * sent * (ep - 1) // ep,
        redundant=plan_redundant_weights(cfg, shape),
    )
