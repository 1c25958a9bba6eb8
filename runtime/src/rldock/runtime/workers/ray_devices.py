"""How a job asks Ray for its devices, and whether this machine has them when the job starts its own Ray.

Ray's `GPU` is a built-in resource: a local Ray declares it with `ray.init(num_gpus=...)` and an actor
asks for it with `num_gpus=...`; naming it in `resources={...}` Ray refuses ("GPU cannot be a custom
resource"). Every other accelerator (`NPU`, the default, emulated on a CPU machine) is a custom
resource. `device_request` is the one place that tells the two apart (cluster.connect and
cluster.seated use it); placement-group bundles name `GPU` and custom resources alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from rldock.config import JobConfig, Problem
from rldock.config.rollout_pool import pool_devices

RAY_GPU = "GPU"  # Ray's built-in GPU resource


def device_request(accelerator: str, amount: float) -> dict[str, Any]:
    """The keyword arguments of `ray.init` or an actor's `.options` that ask for `amount` of `accelerator`."""
    return {"num_gpus": amount} if accelerator == RAY_GPU else {"resources": {accelerator: amount}}


def local_device_problems(cfg: JobConfig, environ: Mapping[str, str] = os.environ) -> list[Problem]:
    """Device settings a local Ray (no RAY_ADDRESS) cannot start on this machine: GPUs asked of Ray
    (`resources.accelerator_resource: GPU`) or of torch (`resources.device: cuda`) where torch sees
    none, or fewer than the job's devices. `rldock validate`, `rldock train` (preflight) and
    cluster.connect call it. On an existing Ray the cluster's nodes hold the devices, not this one."""
    resources = cfg.resources
    wants_gpus = resources.accelerator_resource == RAY_GPU or resources.device == "cuda"
    if environ.get("RAY_ADDRESS") or not wants_gpus:
        return []
    import torch  # heavy: only for a job that asks for GPUs

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    field = "resources.accelerator_resource" if resources.accelerator_resource == RAY_GPU else "resources.device"
    value = RAY_GPU if resources.accelerator_resource == RAY_GPU else "cuda"
    if visible == 0:
        return [
            Problem(
                field,
                f"{value} asks for NVIDIA GPUs, and this machine shows none (torch.cuda.is_available() is false); "
                "on a machine without GPUs set resources.accelerator_resource to NPU (the default: Ray gets "
                "resources.devices_per_node emulated devices) and resources.device to auto or cpu (the torch "
                "side runs on the CPU), or run where GPUs are visible",
            )
        ]
    wanted = cfg.num_devices + pool_devices(cfg)
    if resources.accelerator_resource == RAY_GPU and visible < wanted:
        return [
            Problem(
                "resources.devices_per_node",
                f"{wanted} GPUs (resources.num_nodes x resources.devices_per_node, and rollout.pool.replicas) asked "
                "of a local Ray, "
                f"and this machine shows {visible}; set resources.num_nodes to 1 and resources.devices_per_node "
                f"to {visible} or fewer (with training.data_parallel_size to fit)",
            )
        ]
    return []
