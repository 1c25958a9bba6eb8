"""Dispatch cost of one GRPO iteration: central buffer, distributed dock, TransferQueue, emulated nodes.

Prints one JSON document. For each link cap (default 300 MB/s, the MindSpeed RL paper's
inter-server figure, and uncapped) and each S in --nodes, the same sample flow (grpo_flow.py:
prompts in, responses, old/ref logprobs, rewards, advantages out, the update batch read) runs on
both dock modes and TransferQueue (where installed) over the same S nodes, one rank of every
state per node. Reported per run: wall
seconds from the driver's put to the last update read (median of --repeats after --warmup),
bytes moved per warehouse from the dock's counters against the prediction (Eq. 2 for the central
buffer, Eq. 4 per warehouse; see grpo_flow.predicted_bytes) with the relative error, bytes through
each node's emulated NIC, the raw link bandwidth measured in the same run, the link-bound lower
bound (busiest NIC bytes / raw bandwidth) as a fraction of the measured time, and the speed-ups
of every variant over central and over TransferQueue at the same S.

Needs root for the network namespaces (see emulated_cluster.py); without them it falls back to a
loopback cluster and says so.

    sudo .venv/bin/python -m rldock_benchmarks.dispatch --preset qwen25-7b --scale 1
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys

from rldock_benchmarks import harness, tq_dock
from rldock_benchmarks.grpo_flow import PRESETS, Dims, bytes_per_sample, predicted_bytes

# name -> (dock.mode, prefer_local, colocate_controllers, shared_memory). `distributed-index-order` is an ablation:
# the distributed dock handing samples out in index order, wherever they are stored, to separate
# spreading the traffic over S links from keeping it on the node. `distributed-warehouse-actors`
# has every warehouse an actor of its own and the controller host beside the driver (the layout
# before colocated controllers): two calls per put and get on every node.
# `distributed-no-shared-memory` moves every row through Ray calls, also on the warehouse's node
# (the layout before shared-memory rows). Both switches are TransferDock.create's (JobConfig.ablations). `transferqueue`
# is the PyPI TransferQueue package behind the same client API (tq_dock.py), with one storage
# unit per node; it is skipped, with the reason in the report, where the package is absent.
TRANSFERQUEUE = "transferqueue"
VARIANTS = {
    "central": ("central", True, True, False),
    "distributed": ("distributed", True, True, True),
    "distributed-no-shared-memory": ("distributed", True, True, False),
    "distributed-warehouse-actors": ("distributed", True, False, False),
    "distributed-index-order": ("distributed", False, True, True),
    TRANSFERQUEUE: (TRANSFERQUEUE, False, False, False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen25-7b")
    parser.add_argument("--scale", type=float, default=1.0, help="divide G by this (fit the machine)")
    parser.add_argument("--nodes", default="1,2,4", help="comma-separated S values")
    parser.add_argument("--caps", default="300,none", help="link caps in MB/s, `none` for uncapped")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    parser.add_argument("--bandwidth-mb", type=int, default=300, help="MB sent to measure the raw link")
    parser.add_argument("--role", choices=("orchestrator", "driver"), default="orchestrator", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--node-ip", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def node_counts(args: argparse.Namespace) -> list[int]:
    return [int(s) for s in args.nodes.split(",")]


def scaled_dims(args: argparse.Namespace) -> Dims:
    counts = node_counts(args)
    return PRESETS[args.preset].scaled(args.scale, multiple_of=math.lcm(*counts))


def drive(args: argparse.Namespace) -> dict:
    """Driver role, inside node 0's namespace: every (S, mode) on this cap."""
    from rldock.config.job import DockSpec
    from rldock.runtime.flow.catalogue import get_recipe
    from rldock.runtime.flow.columns import TOKEN_COLUMNS

    CONSUMES = get_recipe("grpo").consumes
    from rldock.runtime.dock import TransferDock

    counts = node_counts(args)
    dims = scaled_dims(args)
    node_ids, cluster = harness.connect(args.address, args.node_ip, max(counts))
    agents, ips = harness.start_agents(node_ids)
    emulated = harness.ray_get_first_counters(agents)
    link = harness.link_bandwidth(agents, ips, args.bandwidth_mb * 10**6) if emulated else None
    variants = args.variants.split(",")
    skipped = {}
    if TRANSFERQUEUE in variants and (reason := tq_dock.unavailable_reason()):
        skipped[TRANSFERQUEUE] = reason
        variants.remove(TRANSFERQUEUE)
        logging.getLogger(__name__).warning("TransferQueue skipped: %s", reason)
    configs = []
    for num_nodes in counts:
        for variant in variants:
            mode, prefer_local, colocate, shared_memory = VARIANTS[variant]
            if mode == TRANSFERQUEUE:
                dock = tq_dock.TQDock.create(
                    states=CONSUMES, num_samples=dims.num_samples, group_size=dims.N, node_ids=node_ids[:num_nodes]
                )
            else:
                dock = TransferDock.create(
                    DockSpec(mode=mode, timeout_s=600),
                    states={s: list(c) for s, c in CONSUMES.items()},
                    num_samples=dims.num_samples,
                    group_size=dims.N,
                    token_columns=TOKEN_COLUMNS,
                    node_ids=node_ids[:num_nodes],
                    prefer_local=prefer_local,
                    colocate_controllers=colocate,
                    shared_memory=shared_memory,
                )
            try:
                owned = [dock.layout.capacity(w) for w in range(dock.layout.num_warehouses)]
                records = harness.run_flow(dock, agents[:num_nodes], dims, repeats=args.repeats, warmup=args.warmup)
            finally:
                dock.shutdown()
            configs.append(summarize(variant, num_nodes, dims, owned, records, link))
            logging.getLogger(__name__).info("%s S=%d: %.3fs", variant, num_nodes, configs[-1]["seconds_median"])
    harness.disconnect(cluster)
    return {
        "link_bandwidth": link,
        "configs": configs,
        "speedup_vs_central": speedups(configs),
        "speedup_vs_transferqueue": speedups(configs, baseline=TRANSFERQUEUE),
        "skipped": skipped,
    }


DOCK_CPU_ROLES = ("dock_actors", "agents", "raylets")  # what "dock CPU per GB moved" counts
PREDICTIONS = {
    "central": "Eq. (2'): one buffer moves V = G*N*b, b counting the prompt once per group (b_driver/N)",
    "distributed": "Eq. (4'): warehouse w moves V * G_w / G (= V/S when S divides G), b as in Eq. (2')",
    TRANSFERQUEUE: "Eq. (4) by samples, prompt N times: unit u moves V_rep * n_u / (G*N), "
    "n_u = samples with index mod S = u",
}


def summarize(
    variant: str, num_nodes: int, dims: Dims, owned: list[int], records: list[dict], link: dict | None
) -> dict:
    predicted = predicted_bytes(dims, owned, prompt_once=variant != TRANSFERQUEUE)
    measured = [int(harness.median([r["warehouse_bytes"][w] for r in records])) for w in range(len(owned))]
    errors = [abs(m - p) / p for m, p in zip(measured, predicted)]
    seconds = [r["seconds"] for r in records]
    summary = {
        "variant": variant,
        "nodes": num_nodes,
        "seconds": [round(s, 4) for s in seconds],
        "seconds_median": round(harness.median(seconds), 4),
        "dispatch_s_sum_median": round(harness.median([r["dispatch_s_sum"] for r in records]), 4),
        "put_s_median": round(harness.median([r["put_s"] for r in records]), 4),
        "states": records[len(records) // 2]["states"],
        "bytes_per_warehouse": measured,
        "predicted_bytes_per_warehouse": predicted,
        "prediction": PREDICTIONS.get(variant, PREDICTIONS["distributed"]),
        "prediction_error_max": round(max(errors), 6),
        "update_tokens_per_rank": records[-1]["update_tokens_per_rank"],
        # CPU seconds by role during the middle measured iteration: where the time goes
        "cpu_s": records[len(records) // 2]["cpu_s"],
    }
    # The dock's CPU (its actors, the agents' client code, the raylets), median over the measured
    # iterations, per GB its counters say it moved.
    dock_cpu = harness.median([sum(r["cpu_s"][k] for k in DOCK_CPU_ROLES) for r in records])
    summary["dock_cpu_s_median"] = round(dock_cpu, 3)
    summary["dock_core_s_per_GB"] = round(dock_cpu / (sum(measured) / 1e9), 2)
    links = records[len(records) // 2]["link_bytes"]
    if link and all(entry is not None for entry in links):
        busiest = max(max(entry["rx_bytes"], entry["tx_bytes"]) for entry in links)
        bound = busiest / (link["MBps"] * 1e6)
        summary["link_bytes_per_node"] = links
        summary["link_bound_s"] = round(bound, 4)
        summary["fraction_of_link_limit"] = round(bound / summary["seconds_median"], 3)
    return summary


def speedups(configs: list[dict], baseline: str = "central") -> dict[str, dict[str, float]]:
    """The baseline's median seconds over each other variant's, per S (above 1: faster than it)."""
    by_key = {(c["variant"], c["nodes"]): c["seconds_median"] for c in configs}
    out: dict[str, dict[str, float]] = {}
    for (variant, s), seconds in by_key.items():
        if variant != baseline and (baseline, s) in by_key:
            out.setdefault(variant, {})[f"S={s}"] = round(by_key[(baseline, s)] / seconds, 3)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if args.role == "driver":
        print(json.dumps(drive(args)))
        return
    caps = [None if c.strip().lower() == "none" else float(c) for c in args.caps.split(",")]
    driver_args = [
        "--preset",
        args.preset,
        "--scale",
        str(args.scale),
        "--nodes",
        args.nodes,
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
        "--bandwidth-mb",
        str(args.bandwidth_mb),
        "--variants",
        args.variants,
    ]
    report = harness.orchestrate(__spec__.name, driver_args, max_nodes=max(node_counts(args)), caps=caps)
    dims = scaled_dims(args)
    per_sample = bytes_per_sample(dims)
    report = {
        "benchmark": "dispatch",
        "preset": args.preset,
        "preset_dims": PRESETS[args.preset].__dict__,
        "scale": args.scale,
        "dims": dims.__dict__,
        "bytes_per_sample": per_sample,
        "V_bytes": per_sample["total"] * dims.num_samples,
        "repeats": args.repeats,
        "warmup": args.warmup,
        **report,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
