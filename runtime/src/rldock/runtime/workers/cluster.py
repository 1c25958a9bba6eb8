"""Connecting to Ray and placing the worker groups on it: one placement group per job, built from
the placement plan (rldock.contract.placement; one bundle per device), every device worker
scheduled into its bundle; and ending the job's actors before their devices go back (`end_actors`).

Inside a RayCluster (the operator sets RAY_ADDRESS) the job joins the existing cluster. Locally it
starts a one-node Ray whose accelerators are a logical resource (`NPU` by default), so the same
placement code runs on a laptop and on Ascend nodes; `GPU` is Ray's built-in resource instead
(num_gpus, rldock.runtime.workers.ray_devices), declared only where torch sees that many GPUs.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence

import ray
import ray._private.state as ray_state  # the actor table, as `ray list actors` reads it
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rldock.config import JobConfig
from rldock.config.rollout_pool import pool_devices
from rldock.contract.placement import CPUS_PER_WORKER, PlacementPlan, Seat
from rldock.contract.pool_nodes import POOL_NODE_LABEL, POOL_NODE_VALUE, POOL_NODES_ENV
from rldock.runtime.agent.service.local import token_variables
from rldock.runtime.dock.shared_columns import process_runs
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import placement_plan
from rldock.runtime.startup import timed
from rldock.runtime.workers.ray_devices import device_request, local_device_problems

logger = logging.getLogger(__name__)

# Logical CPUs for a local Ray. Dock actors take none; compute workers take one each so Ray caps
# their thread pools (OMP_NUM_THREADS) instead of letting every process spawn one thread per core.
_LOCAL_LOGICAL_CPUS = 16
# How long to wait for Ray to reserve the job's devices (a RayCluster may still be adding nodes).
PLACEMENT_TIMEOUT_S = 600.0
# How long `wait_ended` waits for killed actors' processes to end (about 50 ms each here).
END_TIMEOUT_S = 30.0


def connect(cfg: JobConfig) -> None:
    if ray.is_initialized():
        return
    env_vars = {
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM logs every engine start at INFO and a harmless chat-template traceback at WARNING
        # (no tokenizer is loaded: prompts are token ids); a user's own setting wins.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning"),
        # The environment servers' token, which the rollout's clients send (agent/service/auth.py).
        **token_variables(cfg),
    }
    runtime_env = {
        "env_vars": env_vars,
        # each worker's start until its actor is built runs without cyclic collections (rldock.runtime.startup)
        "worker_process_setup_hook": "rldock.runtime.startup.pause_collections",
    }
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=runtime_env)
        return
    resources = cfg.resources
    # Ray probes for real Ascend devices when a resource is called NPU and logs a traceback when
    # the probe's library (acl, from CANN) is absent, which it always is with emulated NPUs.
    logging.getLogger("ray._private.accelerators.npu").setLevel(logging.CRITICAL)
    problems = local_device_problems(cfg)
    if problems:
        raise ValueError("; ".join(map(str, problems)))
    # address="local": always a fresh cluster, never a stray one found on this machine.
    ray.init(
        address="local",
        num_cpus=_LOCAL_LOGICAL_CPUS,
        # the trainer's devices and the rollout pool's, which are apart from them
        **device_request(resources.accelerator_resource, cfg.num_devices + pool_devices(cfg)),
        include_dashboard=False,
        runtime_env=runtime_env,
        logging_level=logging.WARNING,
        # Ray starts idle workers for a first driver ahead of its tasks; a job's actors start
        # workers of their own, so these two only cost ~1 s of CPU each (rldock_benchmarks.startup).
        _system_config={"prestart_worker_first_driver": False},
    )
    logger.info(
        "started a local Ray with %d %s devices", cfg.num_devices + pool_devices(cfg), resources.accelerator_resource
    )


def job_placement(cfg: JobConfig, recipe: Recipe) -> PlacementPlan:
    """The job's placement plan (rldock.contract.placement) for the device workers of its recipe's
    states (their specs' worker groups, rldock.runtime.flow.states)."""
    return placement_plan(cfg, recipe.specs)


class PlacementTimeout(RuntimeError):
    """The cluster never had the devices the placement plan reserves."""


def reserve(plan: PlacementPlan, *, timeout_s: float = PLACEMENT_TIMEOUT_S) -> PlacementGroup:
    """Create the plan's placement group (one bundle per device, packed onto as few nodes as fit,
    so tensor-parallel peers share a node where they can) and wait until Ray has reserved it."""
    # Off the nodes of an RLJob's rollout pool ("!": a node without the label matches), whenever they join.
    avoid_pool = {"bundle_label_selector": [{POOL_NODE_LABEL: f"!{POOL_NODE_VALUE}"}] * len(plan.bundles)}
    group = placement_group(list(plan.bundles), strategy="PACK", **(avoid_pool if pool_nodes_managed() else {}))
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise PlacementTimeout(
            f"Ray could not reserve {plan.num_devices} devices ({plan.accelerator}: 1 and CPU per bundle: "
            f"{[b['CPU'] for b in plan.bundles]}) within {timeout_s:.0f} s; the cluster has "
            f"{ray.cluster_resources().get(plan.accelerator, 0):g} {plan.accelerator}. Add devices "
            "(resources.num_nodes, resources.devices_per_node) or need fewer (training.data_parallel_size, "
            "resources.placement colocated)"
        ) from None
    logger.info(
        "reserved %d devices: %s",
        plan.num_devices,
        "; ".join(f"{i}: {', '.join(plan.workers_on(i))}" for i in range(plan.num_devices)),
    )
    return group


def release(group: PlacementGroup) -> None:
    remove_placement_group(group)


def end_actors(handles: Sequence, *, timeout_s: float = END_TIMEOUT_S) -> list[str]:
    """Kill the actors `handles` and return once they have ended (`wait_ended`)."""
    for handle in handles:
        ray.kill(handle)
    return wait_ended(handles, timeout_s=timeout_s)


def wait_ended(handles: Sequence, *, timeout_s: float = END_TIMEOUT_S) -> list[str]:
    """Return once the actors `handles`, killed, have ended: their processes on this node gone, Ray's
    word that those elsewhere are dead. After `timeout_s` (a job's end never hangs here) it logs a
    warning per actor still running and returns their IDs (none: all ended).

    Why wait: `ray.kill` only asks, and Ray reports the actor dead a moment before its process has
    ended. A placement group removed, or the driver gone, while a killed actor's process still runs
    makes its raylet end it with SIGTERM instead, which Ray's worker turns into SystemExit wherever
    that process is (a traceback in the job's log when it is in a finaliser); and a device's memory
    stays held while the next attempt's workers start on it. Ray's actor table (what `ray list
    actors` reads) keeps each actor's node and pid after its death; another node's /proc is out of
    reach, so there Ray's word is the wait."""
    here = ray.get_runtime_context().get_node_id()
    deadline, running = time.monotonic() + timeout_s, []
    for handle in handles:
        actor_id = handle._actor_id.hex()
        while not _ended(actor_id, here):
            if time.monotonic() > deadline:
                logger.warning("actor %s still runs %.0f s after it was killed", actor_id, timeout_s)
                running.append(actor_id)
                break
            time.sleep(0.005)
    return running


def _ended(actor_id: str, here: str) -> bool:
    entry = ray_state.actors(actor_id=actor_id)
    if entry.get("State") != "DEAD":
        return False
    pid = entry.get("Pid")
    return not (pid and entry.get("Address", {}).get("NodeID") == here and process_runs(pid))


def seated(cls, *, group: PlacementGroup, plan: PlacementPlan, seat: Seat):
    """`cls` as a Ray actor on its seat: its share of the device and its logical CPU, taken from its
    bundle of the placement group."""
    return ray.remote(timed(cls)).options(
        num_cpus=CPUS_PER_WORKER,
        **device_request(plan.accelerator, seat.share),
        max_restarts=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=seat.bundle
        ),
    )


def seated_together(cls, *, group: PlacementGroup, plan: PlacementPlan, seats: Sequence[Seat], max_concurrency: int):
    """`cls` as one Ray actor holding several seats of one bundle (the integrated device worker,
    rldock.runtime.workers.device_worker): their shares of the device and their logical CPUs
    together; threaded, with `max_concurrency` calls at once."""
    [bundle] = {seat.bundle for seat in seats}
    return ray.remote(timed(cls)).options(
        num_cpus=CPUS_PER_WORKER * len(seats),
        **device_request(plan.accelerator, sum(seat.share for seat in seats)),
        max_restarts=0,
        max_concurrency=max_concurrency,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle
        ),
    )


def on_a_device_of_its_own(cls, *, accelerator: str, on_pool_nodes: bool):
    """`cls` as a Ray actor holding one device outside the job's placement group (a rollout pool's engine:
    the pool grows and shrinks apart from the trainer's devices), with its logical CPU; `on_pool_nodes`: on the
    nodes of an RLJob's pool worker group only (rldock.contract.pool_nodes)."""
    placement = {"label_selector": {POOL_NODE_LABEL: POOL_NODE_VALUE}} if on_pool_nodes else {}
    return ray.remote(timed(cls)).options(
        num_cpus=CPUS_PER_WORKER, **device_request(accelerator, 1), max_restarts=0, **placement
    )


def free_devices(accelerator: str) -> float:
    """Devices of `accelerator` no actor or placement group of the cluster holds now."""
    return ray.available_resources().get(accelerator, 0.0)


def pool_nodes_managed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the job runs in an RLJob's RayCluster whose rollout pool is a worker group of its own
    (rldock.contract.pool_nodes: the operator sets POOL_NODES_ENV in its pods)."""
    return environ.get(POOL_NODES_ENV) == POOL_NODE_VALUE


def pool_node_devices(accelerator: str) -> int:
    """Devices of `accelerator` on the alive nodes of the pool's worker group: the pool's size as the operator
    scales it."""
    return int(
        sum(
            node["Resources"].get(accelerator, 0)
            for node in ray.nodes()
            if node["Alive"] and (node.get("Labels") or {}).get(POOL_NODE_LABEL) == POOL_NODE_VALUE
        )
    )


def remote(cls, *, num_cpus: float, resources: dict[str, float] | None = None):
    """`cls` as a Ray actor outside the placement group (the workers that hold no device)."""
    return ray.remote(timed(cls)).options(num_cpus=num_cpus, resources=resources or {}, max_restarts=0)
