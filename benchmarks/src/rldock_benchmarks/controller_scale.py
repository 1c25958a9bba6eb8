"""How one dock controller scales with the samples of an iteration: requests/s and latency percentiles.

Prints one JSON document. A controller (runtime/src/rldock/runtime/dock/controller.py) runs as a plain
object on one asyncio loop, as inside its Ray actor, without Ray, so only the controller's own
work is timed. Two phases per run, each one iteration of --samples samples (groups of --group,
--warehouses warehouses, --ranks consumer ranks each preferring the warehouse of its "node"):
- `ready_first`: every sample is ready, then all ranks request --batch samples until exhausted.
  Per request: the seconds from the call to its grant (pure hand-out work) and requests/s;
- `streaming`: ranks wait while a writer marks samples ready in chunks of --chunk in random group
  order (as rollouts finish). Per write: the seconds mark_ready takes, waking waiters included;
  the wall time of the iteration and requests/s.

`--compare PATH` also runs the same phases, in the same run, on the controller found under PATH
(a runtime/src directory, e.g. of a `git archive` of an earlier commit), each in its own child
process, and reports the ratios:

    python -m rldock_benchmarks.controller_scale --compare /tmp/dock_base/runtime/src
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--group", type=int, default=8, help="samples per prompt group (N)")
    parser.add_argument("--warehouses", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--batch", type=int, default=64, help="samples per request")
    parser.add_argument("--chunk", type=int, default=256, help="samples per write in the streaming phase")
    parser.add_argument("--compare", help="runtime/src of another controller to run side by side")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def percentiles(seconds: list[float]) -> dict[str, float]:
    values = np.asarray(seconds) * 1e3
    return {f"p{q}_ms": round(float(np.percentile(values, q)), 4) for q in (50, 90, 99)} | {
        "max_ms": round(float(values.max()), 4),
        "count": int(values.size),
    }


async def ready_first(args: argparse.Namespace) -> dict:
    from rldock.runtime.dock.controller import Controller
    from rldock.runtime.dock.ownership import DockLayout

    layout = DockLayout(num_samples=args.samples, group_size=args.group, num_warehouses=args.warehouses)
    controller = Controller(state="update", columns=["response_ids", "advantage"], layout=layout, default_timeout_s=600)
    await controller.mark_ready(np.arange(args.samples), ["response_ids", "advantage"])
    latencies: list[float] = []

    async def rank(r: int) -> None:
        prefer = [r % args.warehouses]
        while True:
            started = time.perf_counter()
            grant = await controller.request(r, args.batch, prefer=prefer)
            latencies.append(time.perf_counter() - started)
            if grant.exhausted:
                return

    started = time.perf_counter()
    await asyncio.gather(*(rank(r) for r in range(args.ranks)))
    wall = time.perf_counter() - started
    return {
        "wall_s": round(wall, 4),
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / wall, 1),
        "request_latency": percentiles(latencies),
    }


async def streaming(args: argparse.Namespace) -> dict:
    from rldock.runtime.dock.controller import Controller
    from rldock.runtime.dock.ownership import DockLayout

    layout = DockLayout(num_samples=args.samples, group_size=args.group, num_warehouses=args.warehouses)
    controller = Controller(state="reference", columns=["response_ids"], layout=layout, default_timeout_s=600)
    groups = np.random.default_rng(0).permutation(layout.num_groups)
    per_chunk = max(1, args.chunk // args.group)
    requests = 0
    writes: list[float] = []

    async def rank(r: int) -> None:
        nonlocal requests
        prefer = [r % args.warehouses]
        while True:
            grant = await controller.request(r, args.batch, prefer=prefer)
            requests += 1
            if grant.exhausted:
                return

    async def writer() -> None:
        for first in range(0, groups.size, per_chunk):
            chosen = np.sort(groups[first : first + per_chunk])
            indices = (chosen[:, None] * args.group + np.arange(args.group)).ravel()
            started = time.perf_counter()
            await controller.mark_ready(indices, ["response_ids"])
            writes.append(time.perf_counter() - started)
            await asyncio.sleep(0)  # let the served ranks run, as the actor's loop would

    started = time.perf_counter()
    ranks = [asyncio.ensure_future(rank(r)) for r in range(args.ranks)]
    await asyncio.sleep(0)
    await writer()
    await asyncio.gather(*ranks)
    wall = time.perf_counter() - started
    return {
        "wall_s": round(wall, 4),
        "requests": requests,
        "requests_per_s": round(requests / wall, 1),
        "write_latency": percentiles(writes),
    }


def child(args: argparse.Namespace) -> dict:
    import rldock.runtime.dock.controller as module

    return {
        "controller": os.path.dirname(module.__file__),
        "ready_first": asyncio.run(ready_first(args)),
        "streaming": asyncio.run(streaming(args)),
    }


def run_child(src: str, argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    done = subprocess.run(
        [sys.executable, "-m", __spec__.name, *argv, "--child"], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"controller run under {src} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    shape = {k: getattr(args, k) for k in ("samples", "group", "warehouses", "ranks", "batch", "chunk")}
    passed = [f"--{k}={v}" for k, v in shape.items()]
    import rldock.runtime.dock.controller as module

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(module.__file__))))
    report = {
        "benchmark": "controller_scale",
        "shape": shape,
        "load_note": "timings on a shared, loaded machine",
        "this": run_child(here, passed),
    }
    if args.compare:
        report["baseline"] = run_child(args.compare, passed)
        this, base = report["this"], report["baseline"]
        report["ratios_this_over_baseline"] = {
            "ready_first_requests_per_s": round(
                this["ready_first"]["requests_per_s"] / base["ready_first"]["requests_per_s"], 2
            ),
            "ready_first_p50_latency": round(
                base["ready_first"]["request_latency"]["p50_ms"] / this["ready_first"]["request_latency"]["p50_ms"], 2
            ),
            "streaming_wall": round(base["streaming"]["wall_s"] / this["streaming"]["wall_s"], 2),
            "streaming_p99_write_latency": round(
                base["streaming"]["write_latency"]["p99_ms"] / this["streaming"]["write_latency"]["p99_ms"], 2
            ),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
