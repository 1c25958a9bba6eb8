"""Does a plan fit its device, and if not, which one config field would make it fit.

The candidates are single-field changes, cheapest in compute first; each is re-planned, and the
first that fits is named in the refusal. When none does alone, the refusal names the data-parallel
size FSDP (with the other savings) would need and, beside it, the pipeline stages that would do at the job's
own data-parallel size (where the config takes PP in the job), or, when even checkpointed a pass's activations fill
half the device (a long sequence), first the context-parallel size that splits each sequence enough
(`training.context_parallel_size`, one that divides the heads and KV heads; under pipeline parallelism
too, each stage's CP ranks splitting the positions). More pipeline stages than the model has layers are
refused first, naming training.pipeline_parallel_size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rldock.config import JobConfig
from rldock.config.job_layout import job_layout
from rldock.config.parallel_problems import parallel_problems
from rldock.runtime.planning.memory import (
    GIB,
    MemoryPlan,
    critic_is_sharded,
    engine_dtype,
    fsdp_shard_ranks,
    plan_critic,
    plan_memory,
)
from rldock.runtime.planning.shapes import ModelShape

MAX_SEARCHED_DP = 4096


@dataclass(frozen=True)
class Verdict:
    fits: bool
    field: str | None  # the field to change when it does not fit
    message: str


def _with_training(cfg: JobConfig, **changes) -> JobConfig:
    return cfg.model_copy(update={"training": cfg.training.model_copy(update=changes)})


def _candidates(cfg: JobConfig) -> list[tuple[str, str, Callable[[JobConfig], JobConfig]]]:
    """(field, the change in words (a training.* setting), the changed config), in the order tried."""
    training = cfg.training
    found = []
    if training.strategy == "ddp" and training.tensor_parallel_size == 1 and training.data_parallel_size > 1:
        found.append(("training.strategy", "strategy: fsdp", lambda c: _with_training(c, strategy="fsdp")))
    if not training.gradient_checkpointing:
        found.append(
            (
                "training.gradient_checkpointing",
                "gradient_checkpointing: true",
                lambda c: _with_training(c, gradient_checkpointing=True),
            )
        )
    if training.resharding == "naive":
        found.append(
            (
                "training.resharding",
                "resharding: allgather_swap",
                lambda c: _with_training(c, resharding="allgather_swap"),
            )
        )
    if training.micro_batch_size > 1:
        found.append(
            ("training.micro_batch_size", "micro_batch_size: 1", lambda c: _with_training(c, micro_batch_size=1))
        )
    if training.strategy == "fsdp" and not training.fsdp_cpu_offload:
        found.append(
            ("training.fsdp_cpu_offload", "fsdp_cpu_offload: true", lambda c: _with_training(c, fsdp_cpu_offload=True))
        )
    return found


def _fits(plan: MemoryPlan) -> bool:
    # check_fit makes every plan here with its own device_memory, never None.
    assert plan.device_memory is not None
    return plan.peak <= plan.device_memory


def _engine_refusal(cfg: JobConfig, weights: int, device_memory: int) -> Verdict:
    """The generation replica's weights exceed the engine's share of the device."""
    gen_tp = cfg.rollout.tensor_parallel_size
    share = "one whole replica per rank" if gen_tp == 1 else f"1/{gen_tp} of the model per device"
    dtype = engine_dtype(cfg)
    said = (
        f"the engine's weights ({weights / GIB:.1f} GiB in {dtype}, {share}) exceed rollout.gpu_memory_utilization "
        f"{cfg.rollout.gpu_memory_utilization} of the "
        f"{device_memory / GIB:.1f} GiB device"
    )
    if weights < 0.9 * device_memory:
        return Verdict(
            False,
            "rollout.gpu_memory_utilization",
            f"{said}; raise it above {weights / device_memory:.2f}, leaving room for the KV cache",
        )
    if dtype == "float32" and weights / 2 < 0.9 * device_memory:
        return Verdict(
            False,
            "rollout.dtype",
            f"{said}; rollout.dtype: bfloat16 halves them (training keeps "
            "its float32 weights), then raise rollout.gpu_memory_utilization",
        )
    node = cfg.resources.devices_per_node
    if gen_tp * 2 > node:  # an engine's TP workers run on one node (the rollout section's check)
        return Verdict(
            False,
            "rollout.tensor_parallel_size",
            f"{said}; even in bfloat16 they do not fit, and rollout.tensor_parallel_size {gen_tp} already spans "
            f"what a node's {node} devices allow (an engine's TP workers share a node): use a larger device or "
            "nodes of more devices",
        )
    return Verdict(
        False,
        "rollout.tensor_parallel_size",
        f"{said}; even in bfloat16 they do not fit: raise "
        "rollout.tensor_parallel_size to split the engine over more devices, or use a larger device",
    )


def _critic_refusal(cfg: JobConfig, shape: ModelShape, peak: int, device_memory: int) -> Verdict:
    """A PPO critic rank alone exceeds its device: only its micro-batch, the dtype or the device
    (or, under FSDP, more ranks to shard over) can change that."""
    stages = cfg.training.pipeline_parallel_size
    in_stages = f" a stage, its fullest of {stages} pipeline stages" if stages > 1 else ""
    layout = (
        f"the value model with AdamW sharded over {fsdp_shard_ranks(cfg)} FSDP ranks{in_stages}"
        if critic_is_sharded(cfg)
        else "a full DDP replica of the value model with AdamW"
    )
    need = (
        f"a critic rank (algorithm.name {cfg.algorithm.name}: {layout}) needs {peak / GIB:.1f} GiB > "
        f"{device_memory / GIB:.1f} GiB per device"
    )
    for field, change, changed in (
        ("training.micro_batch_size", "training.micro_batch_size: 1", lambda c: _with_training(c, micro_batch_size=1)),
        (
            "model.dtype",
            "model.dtype: bfloat16",
            lambda c: c.model_copy(update={"model": c.model.model_copy(update={"dtype": "bfloat16"})}),
        ),
    ):
        after = plan_critic(changed(cfg), shape)
        if after is not None and after.peak <= device_memory:
            return Verdict(False, field, f"{need}; set {change} (the critic then {after.peak / GIB:.1f} GiB)")
    if critic_is_sharded(cfg):
        return Verdict(
            False,
            "training.data_parallel_size",
            f"{need}; raise training.data_parallel_size to shard the critic over more ranks, or use a larger device",
        )
    return Verdict(
        False,
        "resources.device_memory_gib",
        f"{need}; critic ranks are not sharded under strategy "
        "ddp: use training.strategy: fsdp with more data-parallel ranks, a larger device or a "
        "smaller model",
    )


def _context_parallel_verdict(lean: JobConfig, shape: ModelShape, *, need: str, device_memory: int) -> Verdict | None:
    """The smallest context_parallel_size (under Ulysses one that divides the heads and KV heads) at which `lean`
    (FSDP, checkpointing, allgather-swap) fits, named as the field to change; None if none does."""
    sequence = lean.algorithm.max_prompt_length + lean.algorithm.max_response_length
    ring = lean.training.context_parallel_mode == "ring"
    # Ulysses splits the heads, so its sizes divide them; ring keeps every head (any size, up to 64).
    for cp in range(lean.training.context_parallel_size + 1, (64 if ring else shape.num_kv_heads) + 1):
        if not ring and (shape.num_heads % cp or shape.num_kv_heads % cp):
            continue
        after = plan_memory(_with_training(lean, context_parallel_size=cp), shape, device_memory=device_memory)
        if _fits(after):
            return Verdict(
                False,
                "training.context_parallel_size",
                f"{need}; a pass's activations ({sequence}-token sequences) fill the device: with strategy fsdp, "
                f"gradient_checkpointing and allgather_swap it needs training.context_parallel_size >= {cp} "
                f"({'ring attention' if ring else 'Ulysses'}: each rank computes 1/{cp} of every sequence; "
                "activations then "
                f"{after.update.activations / GIB:.1f} GiB, peak {after.peak / GIB:.1f} GiB per device)",
            )
    return None


def _stages_that_fit(lean: JobConfig, shape: ModelShape, *, device_memory: int) -> tuple[int, MemoryPlan] | None:
    """The fewest pipeline stages (doubling, at most the model's layers) at which `lean` fits, with its plan;
    None where none does or the config does not take PP in this job (rldock.config's checks: strategy ddp)."""
    stages = lean.training.pipeline_parallel_size * 2
    while stages <= shape.num_layers:
        staged = _with_training(lean, pipeline_parallel_size=stages)
        if any(problem.path == "training.pipeline_parallel_size" for problem in parallel_problems(staged)):
            return None
        after = plan_memory(staged, shape, device_memory=device_memory)
        if _fits(after):
            return stages, after
        stages *= 2
    return None


def _pipeline_words(cfg: JobConfig, found: tuple[int, MemoryPlan]) -> str:
    """The stages found, at the job's data-parallel size, with the devices their actor ranks take where the
    resources give fewer (validate refuses such a job: rldock.config.problems)."""
    stages, after = found
    layout = job_layout(_with_training(cfg, pipeline_parallel_size=stages))
    more = layout.num_actor_ranks > layout.num_devices
    given = f"{layout.num_devices} device{'s' if layout.num_devices > 1 else ''}"
    devices = f"{layout.num_actor_ranks} actor ranks where resources give {given}; " if more else ""
    return (
        f"training.pipeline_parallel_size >= {stages} at data_parallel_size {cfg.training.data_parallel_size} "
        f"({devices}peak then {after.peak / GIB:.1f} GiB; the update idles {after.pipeline_bubble:.3f} of its step "
        "in the bubble)"
    )


def check_fit(cfg: JobConfig, shape: ModelShape, *, device_memory: int) -> Verdict:
    """Whether the job fits `device_memory` bytes per device; a refusal names one field to change."""
    stages = cfg.training.pipeline_parallel_size
    if stages > shape.num_layers:  # the runtime's split refuses it (training/pipeline.py); the planner says so first
        return Verdict(
            False,
            "training.pipeline_parallel_size",
            f"{stages} pipeline stages for the model's {shape.num_layers} layers would leave a stage none; "
            f"use at most {shape.num_layers}",
        )
    plan = plan_memory(cfg, shape, device_memory=device_memory)
    weights = plan.generation.generation_weights
    if cfg.resources.device != "cpu" and weights > cfg.rollout.gpu_memory_utilization * device_memory:
        return _engine_refusal(cfg, weights, device_memory)
    critic = plan.critic
    if critic is not None and critic.peak > device_memory:  # no actor-side change can help it
        return _critic_refusal(cfg, shape, critic.peak, device_memory)
    if _fits(plan):
        return Verdict(True, None, f"fits: peak {plan.peak / GIB:.1f} GiB of {device_memory / GIB:.1f} GiB per device")
    need = f"peak {plan.peak / GIB:.1f} GiB > {device_memory / GIB:.1f} GiB per device"
    for field, change, changed in _candidates(cfg):
        after = plan_memory(changed(cfg), shape, device_memory=device_memory)
        if _fits(after):
            return Verdict(False, field, f"{need}; set training.{change} (peak then {after.peak / GIB:.1f} GiB)")
    lean = _with_training(
        cfg, strategy="fsdp", gradient_checkpointing=True, resharding="allgather_swap", tensor_parallel_size=1
    )
    # Even checkpointed, a pass's activations fill half the device: the sequence, not the model, is the problem.
    if plan_memory(lean, shape, device_memory=device_memory).update.activations > device_memory // 2:
        verdict = _context_parallel_verdict(lean, shape, need=need, device_memory=device_memory)
        if verdict is not None:
            return verdict
    # Pipeline stages divide the training state as more data-parallel ranks do, at the bubble's cost: named
    # beside the data-parallel size, or alone where no data-parallel size fits.
    dp = cfg.training.data_parallel_size
    staged = _stages_that_fit(lean, shape, device_memory=device_memory)
    or_staged = "" if staged is None else f", or {_pipeline_words(lean, staged)}"
    lean_words = "with strategy fsdp, gradient_checkpointing and allgather_swap it needs"
    while dp <= MAX_SEARCHED_DP:
        dp *= 2
        after = plan_memory(_with_training(lean, data_parallel_size=dp), shape, device_memory=device_memory)
        if _fits(after):
            return Verdict(
                False,
                "training.data_parallel_size",
                f"{need}; no single setting fits; {lean_words} training.data_parallel_size >= {dp} "
                f"(peak then {after.peak / GIB:.1f} GiB){or_staged}, or a larger device",
            )
    if staged is not None:
        return Verdict(
            False,
            "training.pipeline_parallel_size",
            f"{need}; no single setting fits; {lean_words} {_pipeline_words(lean, staged)}",
        )
    return Verdict(
        False,
        "resources.device_memory_gib",
        f"{need}; it does not fit even sharded over {MAX_SEARCHED_DP} ranks: the engine and activations "
        "alone exceed the device; lower training.micro_batch_size or the sequence lengths",
    )
