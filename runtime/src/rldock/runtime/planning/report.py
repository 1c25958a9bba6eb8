"""`rldock plan`'s output: the plan as a table (GiB per device) or as JSON (bytes)."""

from __future__ import annotations

from dataclasses import asdict, fields

from rldock.runtime.planning.checkpoint_size import SaveEstimate
from rldock.runtime.planning.memory import GIB, MemoryPlan, PhaseBytes
from rldock.runtime.planning.verdict import Verdict

ROWS = [f.name for f in fields(PhaseBytes)]


def plan_table(plan: MemoryPlan, verdict: Verdict | None, save: SaveEstimate | None = None) -> str:
    pp = f"PP {plan.pipeline_parallel_size} x " if plan.pipeline_parallel_size > 1 else ""
    cp = f"CP {plan.context_parallel_size} x " if plan.context_parallel_size > 1 else ""
    title = (
        f"{plan.model}: {plan.num_params / 1e9:.2f}B parameters, {plan.strategy}, "
        f"{pp}DP {plan.data_parallel_size} x {cp}TP {plan.tensor_parallel_size}, per device (GiB)"
    )
    lines = [title, f"{'':<20}{'update':>10}{'generation':>12}"]
    for row in ROWS:
        label = "host (not device)" if row == "host" else row
        lines.append(f"{label:<20}{getattr(plan.update, row) / GIB:>10.2f}{getattr(plan.generation, row) / GIB:>12.2f}")
    lines.append(
        f"{'device total':<20}{plan.update.device_total / GIB:>10.2f}{plan.generation.device_total / GIB:>12.2f}"
    )
    if plan.engine_sleeps:
        lines.append(
            f"engine asleep through the update; weight push at its end {plan.weight_push / GIB:.2f} GiB "
            "(training state and the engine's woken weights)"
        )
    else:
        lines.append("engine awake through the update (vLLM has no sleep mode on CPU)")
    lines.append(f"KV cache holds {plan.kv_cache_tokens} tokens")
    if plan.context_parallel_size > 1:
        lines.append(f"all-to-all per update step and CP rank {plan.all_to_all_bytes / GIB:.2f} GiB sent")
    if plan.pipeline_parallel_size > 1:
        p, m = plan.pipeline_parallel_size, plan.micro_batches
        lines.append(
            f"pipeline: {p} stages, 1F1B over {m} micro-batches a mini-batch (stage 0 holds {min(p, m)} at once): "
            f"bubble (p - 1) / (m + p - 1) = {plan.pipeline_bubble:.3f} of the update step; "
            "each row above is its fullest stage's"
        )
    if plan.critic is not None:
        where = "beside an actor rank" if plan.critic.beside_actor else "on a device of its own"
        cut = plan.pipeline_parallel_size > 1  # the value model cut into the actor's stages
        sharded = plan.critic.sharded  # FSDP over DP x CP ranks or a stage's, as planning/memory.py planned it
        layout = "FSDP shards" if sharded else "DDP replica"
        stage = f", its fullest of {plan.pipeline_parallel_size} stages" if cut else ""
        lines.append(f"critic rank ({layout}{stage}, {where}), per device (GiB)")
        rows = (
            "params",
            "grads",
            "optimizer_state",
            *(("fsdp_gathered",) if sharded else ()),
            "activations",
        )
        for row in rows:
            lines.append(
                f"{row:<20}{getattr(plan.critic.update, row) / GIB:>10.2f}"
                f"{getattr(plan.critic.generation, row) / GIB:>12.2f}"
            )
        lines.append(
            f"{'device total':<20}{plan.critic.update.device_total / GIB:>10.2f}"
            f"{plan.critic.generation.device_total / GIB:>12.2f}"
        )
    if plan.moe is not None:
        moe = plan.moe
        lines.append(
            f"MoE: {moe.num_experts} experts, top-{moe.top_k}, {moe.active_params / 1e9:.2f}B active parameters; "
            f"EP {moe.expert_parallel_size}: {moe.experts_per_rank} experts per layer per rank "
            f"({moe.expert_bytes_per_rank / GIB:.2f} GiB before FSDP), all-to-all "
            f"{moe.all_to_all_bytes / GIB:.3f} GiB sent per micro-batch forward"
        )
        r = moe.redundant
        # under PP each engine rank holds its own stage's TW and EW (planning/moe_bytes.py's RedundantWeights)
        staged = (
            f", each engine rank's stage's (UPP {plan.pipeline_parallel_size})"
            if plan.pipeline_parallel_size > 1
            else ""
        )
        lines.append(
            f"eq. 3 with GEP: R = GDP {r.generation_replicas} x (TW {r.dense_weight_bytes / GIB:.2f} GiB / UTP + "
            f"EW {r.expert_weight_bytes / GIB:.2f} GiB / GEP {r.generation_expert_split}){staged} = "
            f"{r.paper_bytes / GIB:.2f} GiB; naive resharding here leaves {r.naive_bytes / GIB:.2f} GiB "
            f"(TW / {r.dense_split} + EW / {r.expert_split} per replica), allgather_swap 0"
        )
    if save is not None:
        size = save.size
        critic = f", critic and its moments {size.critic / GIB:.2f}" if size.critic else ""
        lines.append(
            f"checkpoint {size.total / GIB:.2f} GiB (policy {size.policy / GIB:.2f}, AdamW's moments "
            f"{size.optimizer / GIB:.2f}{critic}): saved in about {save.seconds:.0f} s at --write-rate "
            f"{save.write_rate / GIB:.2f} GiB/s"
        )
    if plan.device_memory is not None:
        lines.append(f"device memory {plan.device_memory / GIB:.2f} GiB")
    if verdict is not None:
        lines.append(("OK " if verdict.fits else f"REFUSED ({verdict.field}): ") + verdict.message)
    return "\n".join(lines)


def plan_json(plan: MemoryPlan, verdict: Verdict | None, save: SaveEstimate | None = None) -> dict:
    return {
        "model": plan.model,
        "num_params": plan.num_params,
        "strategy": plan.strategy,
        "data_parallel_size": plan.data_parallel_size,
        "tensor_parallel_size": plan.tensor_parallel_size,
        "context_parallel_size": plan.context_parallel_size,
        "pipeline_parallel_size": plan.pipeline_parallel_size,
        "micro_batches": plan.micro_batches,
        "pipeline_bubble": plan.pipeline_bubble,
        "all_to_all_bytes": plan.all_to_all_bytes,
        "device_memory": plan.device_memory,
        "kv_cache_tokens": plan.kv_cache_tokens,
        "moe": None if plan.moe is None else asdict(plan.moe),
        "update": {**asdict(plan.update), "device_total": plan.update.device_total},
        "generation": {**asdict(plan.generation), "device_total": plan.generation.device_total},
        "weight_push": plan.weight_push,
        "engine_sleeps": plan.engine_sleeps,
        "peak": plan.peak,
        "critic": None
        if plan.critic is None
        else {
            "beside_actor": plan.critic.beside_actor,
            "update": {**asdict(plan.critic.update), "device_total": plan.critic.update.device_total},
            "generation": {**asdict(plan.critic.generation), "device_total": plan.critic.generation.device_total},
        },
        "checkpoint": None
        if save is None
        else {**asdict(save.size), "total": save.size.total, "write_rate": save.write_rate, "save_s": save.seconds},
        "fits": None if verdict is None else verdict.fits,
        "field": None if verdict is None else verdict.field,
        "message": None if verdict is None else verdict.message,
    }
