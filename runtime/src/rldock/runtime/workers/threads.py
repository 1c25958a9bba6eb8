"""Per-worker CPU thread budget: each compute worker process gets its share of the node's cores.

On a CPU node every actor, reference and critic rank runs torch (and the actor's in-process vLLM
engine, which uses the same OpenMP pool), in a process of its own or, under colocated placement,
beside the other ranks of its device in one device worker (workers/device_worker.py), where the
ranks' stages may still run at once, so each rank still counts. Left alone, each takes Ray's
OMP_NUM_THREADS (its num_cpus) or, outside Ray, one thread per core, so ranks either leave cores
idle or oversubscribe them. The budget is `training.num_threads`, by default the node's cores
divided by the compute workers placed on it: the device workers of the job's layout (actor,
reference, critic and reward-model ranks). The reward and advantage workers do no tensor work
worth threads and are not counted.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from rldock.config import JobConfig
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import states_layout

logger = logging.getLogger(__name__)


def thread_share(num_cores: int, num_processes: int) -> int:
    """Threads per process when `num_processes` share `num_cores`: an equal share, at least 1."""
    return max(1, num_cores // max(1, num_processes))


def compute_workers_per_node(cfg: JobConfig, recipe: Recipe) -> int:
    """Compute worker processes on the busiest node: the device workers the job's flow (`recipe`,
    the job's: job_recipe) starts (its
    actor ranks, reference ranks unless the flow skips the reference or LoRA moves it onto the
    actor ranks, critic ranks, reward model), spread evenly over the nodes."""
    layout = states_layout(cfg, recipe.specs)
    return math.ceil(layout.num_device_workers / layout.num_nodes)


def node_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def apply_thread_budget(cfg: JobConfig, recipe: Recipe, *, device_kind: str, role: str) -> int | None:
    """Set this process's torch threads to its budget on CPU devices; returns the threads set, or
    None where nothing was set (an accelerator device, or `training.num_threads: 0`)."""
    setting = cfg.training.num_threads
    if device_kind != "cpu" or setting == 0:
        logger.info("%s: torch threads left at %d", role, torch.get_num_threads())
        return None
    cores, workers = node_cores(), compute_workers_per_node(cfg, recipe)
    threads = setting if setting is not None else thread_share(cores, workers)
    torch.set_num_threads(threads)
    logger.info(
        "%s: %d torch threads (%d cores, %d compute workers on the node, training.num_threads=%s)",
        role,
        threads,
        cores,
        workers,
        setting,
    )
    return threads
