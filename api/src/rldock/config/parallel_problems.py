"""The parallel dimensions' checks that need more than one field (training.problems runs them): context,
expert and pipeline parallelism and HSDP replicas, each in the layouts that have been built and run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rldock.config.job_layout import job_layout
from rldock.config.problem import Problem

if TYPE_CHECKING:
    from rldock.config.job import JobConfig
    from rldock.config.training import TrainingSpec


def parallel_problems(cfg: JobConfig) -> list[Problem]:
    return [
        *_context_parallel_problems(cfg),
        *_expert_parallel_problems(cfg),
        *_replica_problems(cfg.training),
        *_pipeline_problems(cfg),
    ]


def _pipeline_problems(cfg: JobConfig) -> list[Problem]:
    """PP (training.pipeline_parallel_size): stages of FSDP-sharded layers (runtime training/pipeline.py), beside
    TP, CP and EP (the router's load-balancing loss included). DDP's stages would replicate what FSDP shards for
    the same step, and FSDP over one rank holds what a DDP rank would, so PP runs under FSDP only
    (docs/scaling.md, section 12)."""
    training = cfg.training
    pp = training.pipeline_parallel_size
    if pp == 1 or training.strategy == "fsdp":
        return []
    return [
        Problem(
            "training.pipeline_parallel_size",
            f"{pp} runs under strategy fsdp (each stage sharded over its data-parallel ranks, one rank at "
            "data_parallel_size 1): DDP would replicate each stage's layers and optimizer state for the same step; "
            "set training.strategy: fsdp (without the options built for DDP alone: training.lora, "
            "rollout.sleep_level 2, training.micro_batch_tokens)",
        )
    ]


def _context_parallel_problems(cfg: JobConfig) -> list[Problem]:
    """CP (training.context_parallel_size, Ulysses or ring): each CP rank computes a slice of every
    sequence's positions, inside FSDP's data-parallel dimension (its gradient sum over CP is FSDP's
    reduction), over a TP rank's heads where TP splits the layers; Ulysses' heads' divisibility needs the
    model (`_model_problems`)."""
    training, algo = cfg.training, cfg.algorithm
    cp, field = training.context_parallel_size, "training.context_parallel_size"
    if cp == 1:
        return []
    problems: list[Problem] = []
    if training.strategy != "fsdp":
        problems.append(
            Problem(
                field,
                f"{cp} runs under strategy fsdp, which shards over data_parallel_size x context_parallel_size ranks "
                "and sums each CP group's gradient shares; set training.strategy: fsdp",
            )
        )
    sequence = algo.max_prompt_length + algo.max_response_length
    if sequence < cp:
        problems.append(
            Problem(
                field,
                f"{cp} CP ranks each compute a slice of a sequence, but sequences hold at most "
                f"max_prompt_length + max_response_length = {sequence} tokens; use a context_parallel_size "
                f"of at most {sequence}",
            )
        )
    return problems


def _expert_parallel_problems(cfg: JobConfig) -> list[Problem]:
    """EP splits the experts over groups of the dp x cp sequence ranks whose other weights FSDP shards
    (runtime engines/expert_parallel.py, the layout in rldock.contract.layout): the groups must tile
    those ranks, and only the FSDP layout composes with them so far."""
    layout, field = job_layout(cfg), "training.expert_parallel_size"
    if layout.ep == 1:
        return []
    problems = []
    if not layout.experts_divide:
        ranks = layout.num_sequence_ranks
        problems.append(
            Problem(
                field,
                f"{layout.ep} must divide the {ranks} sequence ranks, data_parallel_size {layout.dp} x "
                f"context_parallel_size {layout.cp} (EP groups are carved out of them); use a divisor of {ranks}",
            )
        )
    if cfg.training.strategy != "fsdp":
        problems.append(
            Problem(field, f"{layout.ep} needs training.strategy fsdp (experts sharded beside FSDP's shards); set it")
        )
    return problems


def _replica_problems(training: TrainingSpec) -> list[Problem]:
    """HSDP (training.data_parallel_replicate_size): replicas of FSDP-sharded ranks, which tile the data-parallel
    ranks (beside EP, the experts' own FSDP spans the replicas: runtime engines/expert_parallel.py)."""
    replicas, dp = training.data_parallel_replicate_size, training.data_parallel_size
    why = (
        (training.strategy != "fsdp", "replicas of FSDP shards need training.strategy fsdp; set it, or 1"),
        (dp % replicas > 0, f"must divide data_parallel_size {dp} (each replica holds as many ranks); use a divisor"),
    )
    bad = [f"{replicas} {says}" for failed, says in why if failed and replicas > 1][:1]
    return [Problem("training.data_parallel_replicate_size", message) for message in bad]
