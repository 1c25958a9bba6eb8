"""Memory per rank of the update step under pipeline parallelism and under FSDP x TP, measured on gloo ranks
on the CPU beside the memory planner's figures for the same update, against one rank's in the same run.
Prints one JSON document.

    .venv/bin/python -m rldock_benchmarks.layout_memory          # one rank, PP 2, PP 2 x FSDP 2, FSDP 2 x TP 2
    .venv/bin/python -m rldock_benchmarks.layout_memory --tokens 256 --layouts one_rank pp2

Each layout runs in fresh gloo ranks (torch.multiprocessing, one torch thread each; layouts of one world
size share the ranks' processes, each on a model of its own) through `rldock train`'s own code: the FSDP
backend (`FsdpBackend`) lays the ranks out from the job's sizes, cuts the model into stages
(training/pipeline.py) and splits its decoder layers over TP pairs (resharding/parallelize.py) before
FSDP2 shards what a rank holds over its stage's data-parallel ranks; `accumulate` (training/accumulation.py)
runs the update step: each data-parallel rank's `--micro-batches` micro-batches of one sequence of
`--tokens` tokens (a quarter prompt, no padding) scored by the policy's own pass
(`response_logprobs_and_entropy`) and backpropagated, on the 1F1B schedule when the model is cut into
stages, then the gradient clip and AdamW's step. The model is context_parallel's Qwen2-style one (4 layers,
hidden size 256, float32, sdpa, untied embeddings: `rank_memory.SHAPE`). `one_rank` is the same step on one
rank (FSDP over one), the baseline.

Measured per rank (rldock_benchmarks.rank_memory; a step after the first, so AdamW's state exists):
- `peak_bytes`: the training state the rank starts the step with (its parameter shards and AdamW state,
  summed from the tensors) plus the highest running sum of the step's tensor allocations and frees as
  torch's profiler records them: what a device allocator's peak reports;
- `saved_bytes`: the most bytes autograd keeps for the backward at once (saved-tensor hooks, weights left
  out): under 1F1B a stage holds several micro-batches' (stage s of p: min(p - s, m));
- `state_bytes`: the training state at the step's start (`parameter_tensors`: how many tensors it shards,
  each with AdamW's 4-byte step counter, which the planner leaves out).

Planned per rank, for a job config of the same update (`update_config`: the layout's sizes, m micro-batches
of one row per data-parallel rank): `planned_peak_bytes`, the rank's stage's params, gradients and AdamW
state, FSDP's gathered layers and whole gradients, and the stage's activations (`rank_memory.planned_peak`);
`planned_peak_without_backward_bytes`, the same less what a stage before the last holds beside its saved
activations (its held outputs and a layer's backward working set, planning/activations.py's
`stage_output_bytes` and `backward_working_bytes`), the planner's figure before it counted them, with
`peak_over_planned_without_backward`; `planned_saved_bytes`, what autograd keeps on the stage
(`stage_saved_bytes`); `planned_state_bytes`, its params and AdamW state (the gradients are the step's).
`planned_device_peak_bytes` is `rldock plan`'s one figure for every device of the layout (under PP each
term's fullest stage).

`peak_vs_one_rank` against `planned_peak_vs_one_rank` is how a rank's peak falls from one rank's, measured
and planned; `peak_fall_vs_planned_error` the disagreement (docs/scaling.md, sections 11 and 12).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rldock_benchmarks.rank_memory import (
    SHAPE,
    SavedBytes,
    joined_group,
    model,
    model_shape,
    peak_allocated,
    planned_peak,
    spawned_ranks,
    state_bytes,
    update_config,
    worst_errors,
)

# layout -> its training sizes (FSDP over each stage's data-parallel ranks throughout)
LAYOUTS: dict[str, dict[str, int]] = {
    "one_rank": {},
    "pp2": dict(pipeline_parallel_size=2),
    "pp2_fsdp2": dict(pipeline_parallel_size=2, data_parallel_size=2),
    "fsdp2_tp2": dict(data_parallel_size=2, tensor_parallel_size=2),
}
BASELINE = "one_rank"


def world_size(layout: str) -> int:
    sizes = LAYOUTS[layout]
    return (
        sizes.get("pipeline_parallel_size", 1)
        * sizes.get("data_parallel_size", 1)
        * sizes.get("tensor_parallel_size", 1)
    )


def job_config(layout: str, *, tokens: int, micro_batches: int):
    """The layout's job config for the measured update: m micro-batches of one row per data-parallel rank."""
    sizes = LAYOUTS[layout]
    return update_config(
        prompt_length=tokens // 4,
        response_length=tokens - tokens // 4,
        samples=micro_batches * sizes.get("data_parallel_size", 1),
        devices=world_size(layout),
        **sizes,
    )


def _micro_batches(count: int, tokens: int, dp_rank: int) -> list:
    """A data-parallel rank's `count` micro-batches, one row of `tokens` tokens each (a quarter prompt)."""
    from tensordict import TensorDict

    prompt, response = tokens // 4, tokens - tokens // 4
    g = torch.Generator().manual_seed(dp_rank)
    rows = TensorDict(
        {
            "prompt_ids": torch.randint(4, SHAPE["vocab_size"], (count, prompt), generator=g),  # (m, P)
            "prompt_mask": torch.ones(count, prompt, dtype=torch.int64),
            "response_ids": torch.randint(4, SHAPE["vocab_size"], (count, response), generator=g),  # (m, R)
            "response_mask": torch.ones(count, response, dtype=torch.int64),
        },
        batch_size=[count],
    )
    return [rows[i : i + 1] for i in range(count)]


Job = tuple[str, int, int, bool]  # (layout, tokens, micro-batches, whether to name what is live at the peak)


def _rank(rank: int, world: int, jobs: list[Job], rendezvous: str, out_dir: str) -> None:
    """`jobs` one after the other in this rank's one process group."""
    with joined_group(rank, world, rendezvous):
        for index, (layout, tokens, micro_batches, breakdown) in enumerate(jobs):
            record = _measure(rank, layout, tokens, micro_batches, breakdown=breakdown)
            (Path(out_dir) / f"rank{rank}-job{index}.json").write_text(json.dumps(record))


def _measure(rank: int, layout: str, tokens: int, micro_batches: int, *, breakdown: bool = False) -> dict:
    """One update step of `layout` on a fresh model after a first one: what this rank holds (with
    `breakdown`, also what is live at the peak, by what allocated it: context_parallel_peak's reading)."""
    from torch.profiler import ProfilerActivity, profile

    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.policy import response_logprobs_and_entropy
    from rldock.runtime.training.accumulation import accumulate
    from rldock.runtime.training.fsdp import FsdpBackend

    backend = FsdpBackend(
        job_config(layout, tokens=tokens, micro_batches=micro_batches),  # the backend reads the layout's sizes
        model=model(),
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        device=detect_device("cpu"),
        rank=rank,
    )
    rows = _micro_batches(micro_batches, tokens, backend.context.dp_rank)
    saved = SavedBytes(backend.model)

    def micro_loss(micro):
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            scores = response_logprobs_and_entropy(
                backend.model,
                micro["prompt_ids"],
                micro["prompt_mask"],
                micro["response_ids"],
                micro["response_mask"],
                micro_batch_size=1,
                trim=True,
            )
        loss = -scores.logprobs.sum() / micro["response_mask"].sum() / len(rows)
        return loss, {"loss": float(loss.detach())}

    accumulate(backend, rows, micro_loss, max_grad_norm=1.0)  # allocates AdamW's state
    backend.optimizer.zero_grad(set_to_none=True)  # as the next step's start does: the state is params + AdamW
    saved = SavedBytes(backend.model)
    state = state_bytes(backend.model, backend.optimizer)
    dist.barrier()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        stats = accumulate(backend, rows, micro_loss, max_grad_norm=1.0)
    seconds = time.perf_counter() - start
    live: dict[str, int] = {}
    if breakdown:
        from rldock_benchmarks.context_parallel_peak import live_at_peak

        _, live = live_at_peak(profiler)
    return dict(
        rank=rank,
        stage=backend.pipeline.links.index if backend.pipeline is not None else 0,
        dp_rank=backend.context.dp_rank,
        tp_rank=backend.mesh.local_rank("tp"),
        state_bytes=state,
        parameter_tensors=len(list(backend.model.parameters())),  # each with AdamW's float32 step counter
        peak_bytes=state + peak_allocated(profiler),
        **({"live_at_peak": live} if breakdown else {}),
        saved_bytes=saved.peak_live,
        loss=stats["loss"],
        profiled_seconds=seconds,
    )


def planned(layout: str, stage: int, *, tokens: int, micro_batches: int) -> dict[str, int]:
    """The planner's figures for one rank of `layout`'s pipeline stage `stage` in this update."""
    from rldock.runtime.planning.memory import (
        head_chunk_bytes,
        plan_memory,
        stage_output_bytes,
        stage_saved_bytes,
        stage_training_state_bytes,
        stage_working_bytes,
    )

    cfg = job_config(layout, tokens=tokens, micro_batches=micro_batches)
    shape = model_shape()
    params, _, optimizer = stage_training_state_bytes(cfg, shape, stage)
    last = stage == cfg.training.pipeline_parallel_size - 1
    update = plan_memory(cfg, shape).update
    peak = planned_peak(cfg, shape, stage=stage)
    besides = stage_output_bytes(cfg, shape, stage) + stage_working_bytes(cfg, shape, stage)
    return {
        "planned_state_bytes": params + optimizer,
        "planned_peak_bytes": peak,
        # the plan before a stage's held outputs and backward working set were counted (the LM head's chunk alone)
        "planned_peak_without_backward_bytes": peak - besides + head_chunk_bytes(cfg, shape) * last,
        "planned_saved_bytes": stage_saved_bytes(cfg, shape, stage),
        "planned_device_peak_bytes": update.training_state
        + update.fsdp_gathered
        + update.fsdp_whole_grads
        + update.activations,
    }


def run_layouts(layouts: list[str], *, tokens: int, micro_batches: int, breakdown: bool = False) -> list[dict]:
    """Every rank of each layout: what it measured and the planner's figures beside them. Layouts of one
    world size run in one set of fresh ranks, one after the other. `breakdown`: each rank's `live_at_peak`."""
    by_world: dict[int, list[str]] = {}
    for layout in layouts:
        by_world.setdefault(world_size(layout), []).append(layout)
    rows = []
    for world, group in by_world.items():
        jobs = [(layout, tokens, micro_batches, breakdown) for layout in group]
        with spawned_ranks(_rank, world, world, jobs) as out:
            for index, layout in enumerate(group):
                for r in range(world):
                    record = json.loads((out / f"rank{r}-job{index}.json").read_text())
                    plan = planned(layout, record["stage"], tokens=tokens, micro_batches=micro_batches)
                    rows.append({"layout": layout, **record, **plan})
    return rows


def summarize(rows: list[dict], *, tokens: int, micro_batches: int) -> dict:
    """Each rank's peak and saved bytes over the planner's, and how they fall from one rank's (when the
    run has it), measured against planned; the worst disagreements over all ranks."""
    base = next((row for row in rows if row["layout"] == BASELINE), None)
    for row in rows:
        row["peak_over_planned"] = row["peak_bytes"] / row["planned_peak_bytes"]
        row["peak_over_planned_without_backward"] = row["peak_bytes"] / row["planned_peak_without_backward_bytes"]
        row["saved_over_planned"] = row["saved_bytes"] / row["planned_saved_bytes"]
        if base is not None:
            for kind in ("peak", "saved", "state"):
                row[f"{kind}_vs_one_rank"] = row[f"{kind}_bytes"] / base[f"{kind}_bytes"]
                row[f"planned_{kind}_vs_one_rank"] = row[f"planned_{kind}_bytes"] / base[f"planned_{kind}_bytes"]
                fall, planned_fall = row[f"{kind}_vs_one_rank"], row[f"planned_{kind}_vs_one_rank"]
                row[f"{kind}_fall_vs_planned_error"] = fall / planned_fall - 1
    return {
        "benchmark": "layout_memory",
        "model": SHAPE,
        "tokens_per_micro_batch": tokens,
        "micro_batches_per_data_parallel_rank": micro_batches,
        "rows": rows,
        **worst_errors(rows),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens of a micro-batch's one sequence")
    parser.add_argument("--micro-batches", type=int, default=4, help="per data-parallel rank and step")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument(
        "--live-at-peak", action="store_true", help="each rank's bytes live at its peak, by what allocated them"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = run_layouts(args.layouts, tokens=args.tokens, micro_batches=args.micro_batches, breakdown=args.live_at_peak)
    print(json.dumps(summarize(rows, tokens=args.tokens, micro_batches=args.micro_batches), indent=1))


if __name__ == "__main__":
    main()
