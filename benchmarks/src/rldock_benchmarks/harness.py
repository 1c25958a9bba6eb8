"""Shared machinery of the dock benchmarks: build the emulated cluster, run a driver in it, measure.

A benchmark script has two roles. As the orchestrator (root, host namespace) it builds the
network and the Ray nodes (emulated_cluster.py), then for each link cap runs itself again as the
driver inside node 0's namespace, where the driver connects to Ray, starts one NodeAgent per node
and runs the sample flow (grpo_flow.py). Each driver run prints one JSON document that the
orchestrator collects. Without network namespaces the driver runs here on a loopback cluster
(ray.cluster_utils), and the report says why and that no cap applied.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rldock_benchmarks.emulated_cluster import NODE_RESOURCE, EmulatedNetwork, NetworkRefused, RayNodes, ray_env

logger = logging.getLogger(__name__)
LOOPBACK = "loopback"


def orchestrate(
    module: str, driver_args: list[str], *, max_nodes: int, caps: Sequence[float | None], driver_timeout_s: float = 3600
) -> dict[str, Any]:
    """Build the cluster, run the driver once per cap, tear everything down; what each run printed."""
    started_on = machine()
    network = EmulatedNetwork(num_nodes=max_nodes)
    nodes = RayNodes()
    emulation: dict[str, Any] = {
        "kind": "netns",
        "nodes": max_nodes,
        "bridge": network.bridge,
        "addresses": [network.node_ip(k) for k in range(max_nodes)],
    }
    runs = []
    try:
        try:
            network.up()
        except NetworkRefused as refused:
            network.down()
            emulation = {
                "kind": LOOPBACK,
                "nodes": max_nodes,
                "refused_step": refused.step,
                "detail": refused.detail,
                "cap": "absent: links are loopback, uncapped",
            }
            logger.warning("emulated network refused (%s); falling back to loopback without caps", refused)
        if emulation["kind"] == LOOPBACK:
            caps = [None]
            address = f"{LOOPBACK}:{max_nodes}"
        else:
            address = nodes.start(network)
        for cap in caps:
            cap_note: dict[str, Any] = {"requested_cap_MBps": cap}
            if emulation["kind"] != LOOPBACK:
                try:
                    network.set_cap(cap)
                    cap_note["applied_cap_MBps"] = cap
                except NetworkRefused as refused:
                    network.set_cap(None)
                    cap_note.update(applied_cap_MBps=None, refused_step=refused.step, detail=refused.detail)
            prefix = network.exec_prefix(0) if emulation["kind"] != LOOPBACK else []
            node_ip = network.node_ip(0) if emulation["kind"] != LOOPBACK else "127.0.0.1"
            command = [
                *prefix,
                sys.executable,
                "-m",
                module,
                "--role",
                "driver",
                "--address",
                address,
                "--node-ip",
                node_ip,
                *driver_args,
            ]
            logger.info("driver run with cap %s: %s", cap, " ".join(command))
            done = subprocess.run(command, capture_output=True, text=True, env=ray_env(), timeout=driver_timeout_s)
            if done.returncode != 0:
                raise RuntimeError(f"driver failed (rc {done.returncode}):\n{done.stderr[-6000:]}")
            runs.append({**cap_note, **json.loads(done.stdout.strip().splitlines()[-1])})
    finally:
        nodes.stop()
        network.down()
    return {"emulation": emulation, "machine": {**started_on, "load_average_at_end": os.getloadavg()}, "runs": runs}


def machine() -> dict[str, Any]:
    """What the numbers ran on."""
    import ray
    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    meminfo = Path("/proc/meminfo").read_text().split()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_GiB": round(int(meminfo[1]) / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "ray": ray.__version__,
        "torch": torch.__version__,
        "load_average_at_start": os.getloadavg(),
    }


# --- driver side ------------------------------------------------------------------------------


def connect(address: str, node_ip: str, num_nodes: int):
    """Connect to the emulated cluster (or start a loopback one); node IDs in node order, and the
    loopback Cluster object (None in namespaces) to shut down at the end."""
    import ray

    logging.getLogger("ray").setLevel(logging.ERROR)
    cluster = None
    if address.startswith(LOOPBACK):
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 8, "include_dashboard": False, "resources": {NODE_RESOURCE.format(0): 1}},
        )
        for k in range(1, num_nodes):
            cluster.add_node(num_cpus=8, resources={NODE_RESOURCE.format(k): 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.ERROR)
    else:
        ray.init(address=address, _node_ip_address=node_ip, log_to_driver=False, logging_level=logging.ERROR)
    deadline = time.monotonic() + 120
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= num_nodes or time.monotonic() > deadline:
            break
        time.sleep(1)
    by_index = {}
    for node in alive:
        for k in range(num_nodes):
            if NODE_RESOURCE.format(k) in node["Resources"]:
                by_index[k] = node["NodeID"]
    missing = [k for k in range(num_nodes) if k not in by_index]
    if missing:
        raise RuntimeError(f"emulated nodes {missing} did not join the Ray cluster")
    return [by_index[k] for k in range(num_nodes)], cluster


def disconnect(cluster) -> None:
    """Leave the cluster; a loopback cluster started by `connect` is shut down too."""
    import ray

    ray.shutdown()
    if cluster is not None:
        cluster.shutdown()


def start_agents(node_ids: Sequence[str]) -> tuple[list, list[str]]:
    """One NodeAgent per node, pinned there, and each node's IP address. The agents' module
    travels by value (Ray workers cannot import benchmarks/src/rldock_benchmarks/)."""
    import ray
    from ray import cloudpickle

    from rldock.runtime.dock.placement import pinned_to
    from rldock_benchmarks import grpo_flow

    cloudpickle.register_pickle_by_value(grpo_flow)
    agent_cls = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=0)(grpo_flow.NodeAgent)
    agents = [agent_cls.options(scheduling_strategy=pinned_to(node)).remote(k) for k, node in enumerate(node_ids)]
    return agents, ray.get([a.address.remote() for a in agents])


def link_bandwidth(agents: list, node_ips: Sequence[str], nbytes: int) -> dict[str, Any] | None:
    """Raw TCP throughput from node 1 to node 0 over the emulated links (one stream), MB/s."""
    import ray

    if len(agents) < 2:
        return None
    port = 47000 + int(time.time()) % 1000
    receiving = agents[0].receive.remote(port, nbytes)
    time.sleep(0.5)
    sending = agents[1].send.remote(node_ips[0], port, nbytes)
    seconds = ray.get(receiving)
    ray.get(sending)
    return {
        "MBps": round(nbytes / seconds / 1e6, 1),
        "bytes": nbytes,
        "seconds": round(seconds, 3),
        "path": "node 1 -> node 0, one TCP stream",
    }


def run_flow(
    dock,
    agents: list,
    dims,
    *,
    repeats: int,
    warmup: int,
    device_s_per_sample: float = 0.0,
    on_iteration: Callable[[dict], None] | None = None,
) -> list[dict[str, Any]]:
    """`warmup` + `repeats` iterations of the sample flow on `dock` with one rank per agent; the
    measured ones: wall seconds from the driver's put to the last update read, per-state timings,
    the dock's counter differences and each node's link bytes."""
    import ray
    import torch

    from rldock.runtime.flow.catalogue import get_recipe
    from rldock_benchmarks.grpo_flow import dims_dict, make_prompts

    CONSUMES = get_recipe("grpo").consumes
    from rldock.runtime.dock.grouping import split_group_columns

    # Made before the clock starts: the prompt columns once per group (G,), nothing per sample.
    prompts, per_sample = split_group_columns(make_prompts(dims), dims.N)
    groups = torch.arange(dims.G)
    measured = []
    for iteration in range(warmup + repeats):
        dock.reset()
        stats_before = dock.stats()
        links_before = ray.get([a.link_counters.remote() for a in agents])
        cpu_before = cpu_seconds(dock, agents)
        futures = [
            a.run_state.remote(dock, state, rank, len(agents), dims_dict(dims), device_s_per_sample)
            for rank, a in enumerate(agents)
            for state in CONSUMES
        ]
        time.sleep(0.5)  # let every stage reach its first (waiting) request before the clock starts
        started = time.perf_counter()
        dock.put_groups(groups, prompts, samples=per_sample)
        put_s = time.perf_counter() - started
        results = ray.get(futures)
        seconds = time.perf_counter() - started
        cpu_after = cpu_seconds(dock, agents)
        stats_after = dock.stats()
        links_after = ray.get([a.link_counters.remote() for a in agents])
        if iteration < warmup:
            continue
        record = {
            "seconds": seconds,
            "put_s": put_s,
            "dispatch_s_sum": put_s + sum(r["dispatch_s"] for r in results),
            "states": _per_state(results),
            "warehouse_bytes": [
                (a["bytes_in"] - b["bytes_in"]) + (a["bytes_out"] - b["bytes_out"])
                for a, b in zip(stats_after["warehouses"], stats_before["warehouses"])
            ],
            "update_tokens_per_rank": [r["tokens"] for r in results if r["state"] == "update"],
            "link_bytes": [
                None if a is None else {k: a[k] - b[k] for k in a} for a, b in zip(links_after, links_before)
            ],
            "cpu_s": {k: round(cpu_after[k] - cpu_before.get(k, 0.0), 3) for k in cpu_after},
        }
        measured.append(record)
        if on_iteration:
            on_iteration(record)
    return measured


def cpu_seconds(dock, agents: list) -> dict[str, float]:
    """CPU seconds so far by role: the driver, the node agents (the workers), raylets, the GCS and
    the dock's actors (warehouses and controllers, or the central buffer)."""
    import ray

    out = {"driver": time.process_time(), "agents": 0.0, "raylets": 0.0, "gcs": 0.0}
    for entry in ray.get([a.cpu_seconds.remote() for a in agents]):
        out["agents"] += entry["agent"]
        out["raylets"] += entry["raylet"]
        out["gcs"] += entry.get("gcs", 0.0)
    # Benchmark-only peek at the dock's actors, through Ray's generic per-actor call. The
    # TransferQueue baseline (tq_dock.py) names its controller and storage units itself.
    handles = dock.actor_handles() if hasattr(dock, "actor_handles") else [p.handle for p in dock._route.peers()]
    times = ray.get([h.__ray_call__.remote(lambda self: time.process_time()) for h in handles])
    out["dock_actors"] = sum(times)
    return out


def _per_state(results: list[dict]) -> dict[str, dict[str, float]]:
    states: dict[str, dict[str, float]] = {}
    for r in results:
        entry = states.setdefault(r["state"], {"dispatch_s_max": 0.0, "wait_s_max": 0.0, "samples": 0})
        entry["dispatch_s_max"] = round(max(entry["dispatch_s_max"], r["dispatch_s"]), 4)
        entry["wait_s_max"] = round(max(entry["wait_s_max"], r["wait_s"]), 4)
        entry["samples"] += r["num_samples"]
    return states


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ray_get_first_counters(agents: list) -> bool:
    """Whether the nodes have emulated NICs whose counters can be read (False on loopback)."""
    import ray

    return ray.get(agents[0].link_counters.remote()) is not None
