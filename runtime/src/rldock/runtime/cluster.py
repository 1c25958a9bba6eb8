"""Connecting to Ray and placing the worker groups on it.

Inside a RayCluster (the operator sets RAY_ADDRESS) the job joins the existing cluster. Locally it
starts a one-node Ray whose accelerators are a logical resource (`NPU` by default), so the same
placement code runs on a laptop and on Ascend nodes.
"""

from __future__ import annotations

import logging
import os

import ray

from rldock.config import JobConfig

logger = logging.getLogger(__name__)

# Logical CPUs for a local Ray. Dock actors take none; compute workers take one each so Ray caps
# their thread pools (OMP_NUM_THREADS) instead of letting every process spawn one thread per core.
_LOCAL_LOGICAL_CPUS = 16


def connect(cfg: JobConfig) -> None:
    if ray.is_initialized():
        return
    env_vars = {
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM logs every engine start at INFO and a harmless chat-template traceback at WARNING
        # (no tokenizer is loaded: prompts are token ids); a user's own setting wins.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "PYTHONWARNINGS": os.environ.get("PYTHONWARNINGS", "ignore::FutureWarning"),
    }
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env_vars})
        return
    resources = cfg.resources
    # Ray probes for real Ascend devices when a resource is called NPU and logs a traceback when
    # the probe's library (acl, from CANN) is absent, which it always is with emulated NPUs.
    logging.getLogger("ray._private.accelerators.npu").setLevel(logging.CRITICAL)
    # address="local": always a fresh cluster, never a stray one found on this machine.
    ray.init(address="local", num_cpus=_LOCAL_LOGICAL_CPUS,
             resources={resources.accelerator_resource: resources.num_nodes * resources.devices_per_node},
             include_dashboard=False, runtime_env={"env_vars": env_vars}, logging_level=logging.WARNING)
    logger.info("started a local Ray with %d emulated %s devices", cfg.num_devices,
                resources.accelerator_resource)


def device_share(cfg: JobConfig) -> dict[str, float]:
    """Accelerator request of one actor or reference rank: the two share a device (all-in-one
    placement, as in the MindSpeed RL paper), so each asks for half of one."""
    return {cfg.resources.accelerator_resource: 0.5}


def remote(cls, *, num_cpus: float, resources: dict[str, float] | None = None):
    return ray.remote(cls).options(num_cpus=num_cpus, resources=resources or {}, max_restarts=0)
