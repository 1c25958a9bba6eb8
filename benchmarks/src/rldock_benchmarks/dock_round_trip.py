"""Latency of one dock round trip from a worker actor: reset, put and get of a few samples.

Prints one JSON document. One local Ray session; two distributed docks of --warehouses
warehouses each; one worker actor that, each round, runs `reset`, `put` of --samples samples and
`get` of them on each dock:
- `colocated` (the default, TransferDock.create's `colocate_controllers`): the controller host holds the
  warehouses of its node, here all of them: a put or get is one call to it (host.py);
- `warehouse_actors`: every warehouse an actor of its own, as on a node without the host: a get
  asks the host, then reads the warehouses; a put writes them, then tells the host.
The two alternate round by round, so both see the same load. Reported: per call and dock, the
median, p90 and mean milliseconds over --rounds rounds after --warmup, and the ratio colocated
over warehouse_actors of the medians (below 1: colocated is faster). Columns are --columns int64
columns of --length tokens per sample.

    python -m rldock_benchmarks.dock_round_trip --rounds 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

CALLS = ("reset", "put", "get")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=4, help="samples per put and per get")
    parser.add_argument("--warehouses", type=int, default=1)
    parser.add_argument("--columns", type=int, default=2)
    parser.add_argument("--length", type=int, default=16, help="tokens per sample and column")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    return parser.parse_args(argv)


class RoundTripper:
    """A worker actor timing dock calls, as a worker state's loop makes them."""

    def run(
        self, docks: dict, *, samples: int, columns: int, length: int, rounds: int, warmup: int
    ) -> dict[str, dict[str, list[float]]]:
        import torch
        from tensordict import TensorDict

        names = [f"column_{j}" for j in range(columns)]
        batch = TensorDict(
            {name: torch.arange(samples * length).reshape(samples, length) for name in names}, batch_size=[samples]
        )  # (B, T) int64 each
        indices = torch.arange(samples)
        seconds: dict[str, dict[str, list[float]]] = {c: {call: [] for call in CALLS} for c in docks}
        for r in range(warmup + rounds):
            order = list(docks) if r % 2 == 0 else list(reversed(docks))
            for client in order:
                dock = docks[client]
                started = time.perf_counter()
                dock.reset()
                reset_done = time.perf_counter()
                dock.put(indices, batch)
                put_done = time.perf_counter()
                got = dock.get("consumer", names, batch_size=samples)
                get_done = time.perf_counter()
                if got is None or got[0].tolist() != indices.tolist():
                    raise RuntimeError(f"{client}: the dock handed out {got and got[0].tolist()}, not the put samples")
                if r >= warmup:
                    for call, value in zip(CALLS, (reset_done - started, put_done - reset_done, get_done - put_done)):
                        seconds[client][call].append(value)
        return seconds


def summarize(seconds: dict[str, dict[str, list[float]]]) -> dict:
    out: dict = {}
    for client, calls in seconds.items():
        out[client] = {}
        for call, values in calls.items():
            ms = np.asarray(values) * 1e3
            out[client][call] = {
                "median_ms": round(float(np.median(ms)), 3),
                "p90_ms": round(float(np.percentile(ms, 90)), 3),
                "mean_ms": round(float(ms.mean()), 3),
                "count": int(ms.size),
            }
    out["colocated_over_warehouse_actors_median"] = {
        call: round(out["colocated"][call]["median_ms"] / out["warehouse_actors"][call]["median_ms"], 3)
        for call in CALLS
    }
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import ray
    from ray import cloudpickle

    from rldock.config.job import DockSpec
    from rldock.runtime.dock import TransferDock

    if __name__ != "__main__":  # Ray workers cannot import the benchmarks package (__main__ goes by value anyway)
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    states = {"consumer": [f"column_{j}" for j in range(args.columns)]}
    docks = {}
    try:
        for name, colocate in (("colocated", True), ("warehouse_actors", False)):
            spec = DockSpec(num_warehouses=args.warehouses, timeout_s=60)
            docks[name] = TransferDock.create(
                spec, states=states, num_samples=args.samples, group_size=1, colocate_controllers=colocate
            )
        worker = ray.remote(num_cpus=0)(RoundTripper).remote()
        seconds = ray.get(
            worker.run.remote(
                docks,
                samples=args.samples,
                columns=args.columns,
                length=args.length,
                rounds=args.rounds,
                warmup=args.warmup,
            )
        )
        for dock in docks.values():
            dock.shutdown()
    finally:
        ray.shutdown()
    report = {"benchmark": "dock_round_trip", "args": vars(args), "load_average": os.getloadavg(), **summarize(seconds)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
