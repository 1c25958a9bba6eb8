"""Context parallelism on the CPU, Ulysses and ring attention: update time, peak memory per rank and
bytes sent against sequence length at CP 1, 2 and 4, beside the memory planner's figures for the
same update. Prints one JSON document.

    .venv/bin/python -m rldock_benchmarks.context_parallel                       # 512..2048 tokens
    .venv/bin/python -m rldock_benchmarks.context_parallel --lengths 1024 4096 --cp 1 2 --modes ring

Each (CP size, length) runs in fresh gloo ranks (torch.multiprocessing, one torch thread each) laid out
as a job's DP 1 x CP cp update: a Qwen2-style model (float32, sdpa) given Ulysses attention over the
CP group and FSDP2 over the CP ranks with the gradients summed over CP, exactly as `rldock train`'s
FSDP backend does (`ContextLayout`, `apply_fsdp`), scores one sequence of that many tokens (a prompt
of a quarter of them and a response) through the policy's own pass (`response_logprobs_and_entropy`),
backpropagates a loss on the logprobs and steps AdamW: the update step. CP 1 is the same step on one
rank, the baseline, in the same run.

Measured per rank:
- `peak_bytes`: the most tensor memory the rank holds during one update step (a step after the first,
  so AdamW's state exists): the training state it starts with (its parameter shards and their AdamW
  state, summed from the tensors) plus the highest running sum of the step's tensor allocations and
  frees as torch's profiler records them (`profile_memory`): what a device allocator's peak reports
  (torch.cuda.max_memory_allocated), free of the process's RSS and allocator slack. The planner's
  figure for it is the update phase's params + grads + optimizer state + FSDP's gathered layers +
  the gradients FSDP holds whole + activations (`planned_peak_bytes`; the engine's share is not in this benchmark);
- `saved_bytes`: the distinct storages autograd saves for the backward during the pass (weights
  left out), counted with saved-tensor hooks: what the planner's activation formula estimates, less
  the transient (the LM head's chunk or a layer's backward working set: `planned_saved_bytes`, the
  planner's `stage_saved_bytes`);
- `all_to_all_bytes`: what the rank sent other ranks in one step: through the all-to-alls (Ulysses)
  and the ring's sends (ring), counted by wrapping torch.distributed.all_to_all_single and
  batch_isend_irecv in the rank (measuring wrappers, benchmark only);
- `seconds`: the median of `--steps` unprofiled steps after the first. The CP ranks share this
  machine's cores with each other and with whatever else runs, so CP does not make a step faster
  here: the figure shows what the exchange costs, not the speed-up of ranks on devices of their own.

`peak_vs_cp1` against `planned_peak_vs_cp1` (and `saved_vs_cp1` against `planned_saved_vs_cp1`) is
how memory per rank falls with CP, measured and planned; `max_peak_fall_vs_planned_error` the worst
disagreement. A ring row's `seconds_vs_ulysses` and `peak_vs_ulysses` compare it with the Ulysses
row of the same CP size and length, run in the same ranks (`--modes`, both by default; CP 1 runs
once, as neither).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rldock_benchmarks.rank_memory import (
    SHAPE,
    SavedBytes,
    joined_group,
    model_shape,
    peak_allocated,
    planned_peak,
    spawned_ranks,
    state_bytes,
    update_config,
    worst_errors,
)
from rldock_benchmarks.rank_memory import model as _model


def _batch(length: int) -> dict[str, torch.Tensor]:
    prompt, response = length // 4, length - length // 4
    g = torch.Generator().manual_seed(length)
    return dict(
        prompt_ids=torch.randint(4, SHAPE["vocab_size"], (1, prompt), generator=g),
        prompt_mask=torch.ones(1, prompt, dtype=torch.int64),
        response_ids=torch.randint(4, SHAPE["vocab_size"], (1, response), generator=g),
        response_mask=torch.ones(1, response, dtype=torch.int64),
    )


Job = tuple[int, int, str, str]  # (length, steps, dtype, mode)


def _rank(rank: int, cp: int, jobs: list[Job], rendezvous: str, out_dir: str) -> None:
    """`jobs` one after the other in this rank's one process group."""
    with joined_group(rank, cp, rendezvous):
        _jobs(rank, cp, jobs, out_dir)


def _jobs(rank: int, cp: int, jobs: list[Job], out_dir: str) -> None:
    sent = [0]
    exchange, pairs = dist.all_to_all_single, dist.batch_isend_irecv

    def counting_all_to_all(output, input, *args, **kwargs):  # noqa: A002 (torch's parameter name)
        sent[0] += input.numel() * input.element_size() * (cp - 1) // cp  # the chunks for other ranks
        return exchange(output, input, *args, **kwargs)

    def counting_sends(operations):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in operations if op.op is dist.isend)
        return pairs(operations)

    # the measuring wrappers; the ring attention module looks both up on `dist` at each call
    dist.all_to_all_single = counting_all_to_all  # type: ignore[assignment]
    dist.batch_isend_irecv = counting_sends  # type: ignore[assignment]
    for index, (length, steps, dtype, mode) in enumerate(jobs):
        record = _job(cp, length, steps, dtype, mode, sent)
        (Path(out_dir) / f"rank{rank}-job{index}.json").write_text(json.dumps(record))


def _job(cp: int, length: int, steps: int, dtype: str, mode: str, sent: list[int]) -> dict:
    """One (length, dtype) update on a fresh model: `steps` timed steps after the first, then one
    profiled; what it measured. `sent` counts the bytes the all-to-all wrapper sends."""
    from torch.profiler import ProfilerActivity, profile

    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.fsdp_sharding import apply_fsdp
    from rldock.runtime.engines.policy import response_logprobs_and_entropy
    from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh
    from rldock.runtime.training.context_parallel import ContextLayout

    model = _model(dtype)
    # DP 1 x CP cp as rldock train's FSDP backend lays it out: the mode's attention, FSDP over the ranks,
    # the sum over CP
    mesh = ParallelMesh(MeshShape(dp=dist.get_world_size() // cp, cp=cp), "cpu")
    layout = ContextLayout.of(model, mesh=mesh, mode=mode)
    model = apply_fsdp(model, detect_device("cpu"), mesh)
    layout.sum_gradients(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = _batch(length)

    def step(saved: SavedBytes) -> float:
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            scores = response_logprobs_and_entropy(model, **batch, micro_batch_size=1, trim=True)
        loss = -scores.logprobs.sum() / batch["response_mask"].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    times = []
    for _ in range(1 + steps):  # the first allocates AdamW's state; the others are timed
        dist.barrier()
        start = time.perf_counter()
        step(SavedBytes(model))
        times.append(time.perf_counter() - start)
    sent[0] = 0
    saved = SavedBytes(model)
    state = state_bytes(model, optimizer)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        loss = step(saved)
    return dict(
        saved_bytes=saved.bytes,
        state_bytes=state,
        peak_bytes=state + peak_allocated(profiler),
        all_to_all_bytes=sent[0],
        loss=loss,
        seconds=statistics.median(times[1:]) if len(times) > 1 else times[0],
    )


def planned(length: int, cp: int, mode: str = "ulysses") -> dict[str, int]:
    """The planner's update peak, activations and bytes sent for one rank of this step."""
    from rldock.runtime.planning.context_parallel_bytes import context_bytes_per_pass
    from rldock.runtime.planning.memory import activation_bytes, stage_saved_bytes

    cfg = update_config(
        prompt_length=length // 4,
        response_length=length - length // 4,
        samples=2,
        devices=cp,
        context_parallel_size=cp,
        context_parallel_mode=mode,
    )
    shape = model_shape()
    return {
        "planned_peak_bytes": planned_peak(cfg, shape),
        "planned_saved_bytes": stage_saved_bytes(cfg, shape, 0),  # activations less the transient
        "planned_activation_bytes": activation_bytes(cfg, shape),
        "planned_all_to_all_bytes": context_bytes_per_pass(shape, mode=mode, tokens=length, cp=cp, element=4),
    }


def run_jobs(cp: int, jobs: list[Job]) -> list[dict]:
    """`jobs` ((length, steps, dtype, mode) each) in turn in one set of fresh ranks, each on a model of
    its own, sharing the ranks' processes (starting them is most of a small job's cost). A dtype other
    than float32 (the planner's figures' dtype) is for comparing the CP sizes' losses: float64 sums in
    any order agree to ~1e-12."""
    with spawned_ranks(_rank, cp, cp, jobs) as out:
        found = [
            [json.loads((out / f"rank{r}-job{index}.json").read_text()) for r in range(cp)]
            for index in range(len(jobs))
        ]
    return [_row(cp, length, mode, ranks) for (length, _, _, mode), ranks in zip(jobs, found)]


def _row(cp: int, length: int, mode: str, ranks: list[dict]) -> dict:
    """One job's ranks' records with the planner's figures beside them."""
    plan = planned(length, cp, mode)
    keys = ("peak_bytes", "state_bytes", "saved_bytes", "all_to_all_bytes")
    worst = {key: max(r[key] for r in ranks) for key in keys}
    return {
        "cp": cp,
        "mode": mode if cp > 1 else None,
        "tokens": length,
        "seconds": max(r["seconds"] for r in ranks),
        "loss": ranks[0]["loss"],
        **{f"max_rank_{key}": value for key, value in worst.items()},
        **plan,
        "peak_over_planned": worst["peak_bytes"] / plan["planned_peak_bytes"],
        "saved_over_planned": worst["saved_bytes"] / plan["planned_saved_bytes"],
        "all_to_all_over_planned": (
            worst["all_to_all_bytes"] / plan["planned_all_to_all_bytes"] if plan["planned_all_to_all_bytes"] else None
        ),
    }


def summarize(rows: list[dict]) -> dict:
    """Per length, each CP size's memory and time relative to CP 1 of the same run, and a ring row's
    relative to Ulysses at the same CP size and length."""
    by = {(row["cp"], row["tokens"], row["mode"]): row for row in rows}
    for row in rows:
        ulysses = by.get((row["cp"], row["tokens"], "ulysses"))
        if row["mode"] == "ring" and ulysses is not None:
            row["seconds_vs_ulysses"] = row["seconds"] / ulysses["seconds"]
            row["peak_vs_ulysses"] = row["max_rank_peak_bytes"] / ulysses["max_rank_peak_bytes"]
            row["bytes_sent_vs_ulysses"] = row["max_rank_all_to_all_bytes"] / ulysses["max_rank_all_to_all_bytes"]
        base = by.get((1, row["tokens"], None))
        if base is not None:
            for kind in ("peak", "saved"):
                row[f"{kind}_vs_cp1"] = row[f"max_rank_{kind}_bytes"] / base[f"max_rank_{kind}_bytes"]
                row[f"planned_{kind}_vs_cp1"] = row[f"planned_{kind}_bytes"] / base[f"planned_{kind}_bytes"]
                row[f"{kind}_fall_vs_planned_error"] = row[f"{kind}_vs_cp1"] / row[f"planned_{kind}_vs_cp1"] - 1
            row["seconds_vs_cp1"] = row["seconds"] / base["seconds"]
    return {
        "benchmark": "context_parallel",
        "model": SHAPE,
        "rows": rows,
        **worst_errors(rows),
        "max_all_to_all_vs_planned_error": max(
            (abs(row["all_to_all_over_planned"] - 1) for row in rows if row["all_to_all_over_planned"] is not None),
            default=0.0,
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=("ulysses", "ring"), default=["ulysses", "ring"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for cp in args.cp:  # one set of ranks per CP size; CP 1 runs once, as neither mode
        modes = args.modes if cp > 1 else args.modes[:1]
        rows += run_jobs(cp, [(length, args.steps, "float32", mode) for length in args.lengths for mode in modes])
    print(json.dumps(summarize(rows), indent=1))


if __name__ == "__main__":
    main()
