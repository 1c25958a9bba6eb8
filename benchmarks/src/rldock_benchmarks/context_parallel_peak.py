"""What each rank holds at the context-parallel update step's peak, by what allocated it: the
breakdown behind the planner's FSDP terms (docs/scaling.md, section 9). Prints one JSON document.

    .venv/bin/python -m rldock_benchmarks.context_parallel_peak                  # 512 tokens, CP 1 2 4
    .venv/bin/python -m rldock_benchmarks.context_parallel_peak --length 2048 --cp 2 --mode ring

The step is rldock_benchmarks.context_parallel's (the same ranks, model and profiled step); this
module only reads its profile differently: the allocations still live at the moment of the peak,
each named by the record the profiler filed it under. FSDP2 names its own (`FSDP::pre_forward`,
`FSDP::all_gather (model.layers.1)`, `FSDP::post_backward_reduce (model.layers.3)`, ...: gathered
weights, all-gather buffers, reduce-scatter inputs and outputs; `... > c10d::reduce_scatter_tensor_coalesced_`
where the collective allocated it, gloo's own buffers); the others are named by the
autograd function whose backward made them (`bwd _HeadLogprobsBackward`: the LM head's gradient
among them) or, made in the forward, by the outermost op (`fwd aten::linear`: activations). Bytes are
those the step allocated: the state the rank started with (its parameter shards and AdamW state,
`state_bytes`) comes on top.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from rldock_benchmarks import context_parallel
from rldock_benchmarks.rank_memory import spawned_ranks


def allocations(profiler) -> list[tuple[int, int, int, list[str]]]:
    """(time ns, bytes (negative: a free), address, the names of the records around it, innermost
    first) of every allocation a profiled window made, in time order."""
    from torch._C._profiler import _EventType

    found = []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            names, parent = [], event.parent
            while parent is not None:
                names.append(parent.name)
                parent = parent.parent
            found.append((event.start_time_ns, event.extra_fields.alloc_size, event.extra_fields.ptr, names))
        stack.extend(event.children)
    return sorted(found, key=lambda found_one: found_one[0])


def label(names: list[str]) -> str:
    """What made an allocation: FSDP's innermost record (with the collective's, `c10d::...`, where the
    process group allocated it: gloo's own work buffers), else the backward's autograd function, else
    the forward's outermost op."""
    fsdp = [name for name in names if name.startswith("FSDP::")]
    if fsdp:
        collective = [name for name in names if name.startswith("c10d::")]
        return fsdp[0] + (f" > {collective[0]}" if collective else "")
    backward = [name for name in names if name.startswith("autograd::engine::evaluate_function: ")]
    if backward:
        return "bwd " + backward[-1].removeprefix("autograd::engine::evaluate_function: ")
    return "fwd " + (names[-1] if names else "?")


def live_at_peak(profiler) -> tuple[int, dict[str, int]]:
    """The window's allocation peak (as rank_memory's `peak_allocated` counts it) and the bytes
    still live at that moment by `label`, largest first."""
    events = allocations(profiler)
    running = peak = 0
    at = -1
    for index, (_, size, _, _) in enumerate(events):
        running += size
        if running > peak:
            peak, at = running, index
    live: dict[int, tuple[int, str]] = {}
    for _, size, address, names in events[: at + 1]:
        if size > 0:
            live[address] = (size, label(names))
        else:
            live.pop(address, None)
    by_label: dict[str, int] = defaultdict(int)
    for size, name in live.values():
        by_label[name] += size
    return peak, dict(sorted(by_label.items(), key=lambda item: -item[1]))


def _rank(rank: int, cp: int, jobs: list, rendezvous: str, out_dir: str) -> None:
    """context_parallel's rank, its peak read by `live_at_peak` (a measuring wrapper, benchmark only)."""

    def peak_and_breakdown(profiler) -> int:
        peak, live = live_at_peak(profiler)
        (Path(out_dir) / f"rank{rank}-live.json").write_text(json.dumps(live))
        return peak

    context_parallel.peak_allocated = peak_and_breakdown  # type: ignore[assignment]
    context_parallel._rank(rank, cp, jobs, rendezvous, out_dir)


def run(cp: int, length: int, mode: str = "ulysses") -> dict:
    """One (CP size, length) update in fresh ranks under `mode`'s attention: the rank with the highest peak, its
    breakdown."""
    with spawned_ranks(_rank, cp, cp, [(length, 1, "float32", mode)]) as out:
        ranks = [
            {
                **json.loads((out / f"rank{r}-job0.json").read_text()),
                "live_at_peak": json.loads((out / f"rank{r}-live.json").read_text()),
            }
            for r in range(cp)
        ]
    worst = max(ranks, key=lambda record: record["peak_bytes"])
    return {
        "cp": cp,
        "mode": mode,
        "tokens": length,
        "peak_bytes": worst["peak_bytes"],
        "state_bytes": worst["state_bytes"],
        "live_at_peak": worst["live_at_peak"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--mode", choices=("ulysses", "ring"), default="ulysses")
    args = parser.parse_args(argv)
    rows = [run(cp, args.length, args.mode) for cp in args.cp]
    print(json.dumps({"benchmark": "context_parallel_peak", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
