"""Which devices each generation replica's engine sees: the replica's devices, its own first.

Ray shows every actor only the device of its own seat (ASCEND_RT_VISIBLE_DEVICES on Ascend,
CUDA_VISIBLE_DEVICES on NVIDIA). At `rollout.tensor_parallel_size` g > 1 the first rank of each
replica of g consecutive actor ranks starts one vLLM engine whose multiprocessing executor spawns g
TP worker processes, worker i on local device i. Those children inherit the engine rank's
environment, so before its engine starts the engine rank's visible devices become the replica's
devices in rank order with its own first: TP worker 0 then sits on the rank's own device (where the
weights pushed from its training copy already are) and worker i on a peer's. The other ranks keep
their own device for training. The actor's own process has already opened its device by then and
keeps it as local index 0, which is still its device in the new list.

The trainer asks each actor rank where Ray put it (`seat_of_this_actor`, run inside the actor) and
hands each engine rank the environment `engine_environments` (pure) returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import ray

from rldock.runtime.device import VISIBLE_DEVICES_ENVS

# The Ray resource whose ids are this device kind's visible-device indices.
RAY_ACCELERATOR = {"npu": "NPU", "cuda": "GPU"}


@dataclass(frozen=True)
class RankDevice:
    """Where Ray put one actor rank: its node, its device kind and the accelerator ids it sees."""

    node_id: str
    device_kind: str  # "npu", "cuda" or "cpu" (DeviceInfo.kind)
    device_ids: tuple[str, ...]  # Ray's accelerator ids for the job's device resource


def seat_of_this_actor(*, accelerator_resource: str, device_kind: str) -> RankDevice:
    """The calling Ray actor's node and the ids Ray assigned it of `accelerator_resource` (e.g. NPU)."""
    context = ray.get_runtime_context()
    ids = context.get_accelerator_ids().get(accelerator_resource, [])
    return RankDevice(
        node_id=context.get_node_id(),
        device_kind=device_kind,
        device_ids=visible_ids(device_kind, accelerator_resource, ids),
    )


def visible_ids(device_kind: str, accelerator_resource: str, ids: Sequence[str]) -> tuple[str, ...]:
    """Ray's ids of `accelerator_resource` when they index this device kind's visible devices; none
    otherwise (NPU ids must not become CUDA_VISIBLE_DEVICES), so that engine_environments refuses
    the replica naming resources.accelerator_resource."""
    return tuple(ids) if RAY_ACCELERATOR.get(device_kind, accelerator_resource) == accelerator_resource else ()


def engine_environments(ranks: Sequence[RankDevice], *, generation_tp: int) -> dict[int, dict[str, str]]:
    """Actor rank -> the environment variables its engine needs, for the engine ranks that need
    any: none at generation TP 1 or on the CPU (vLLM's CPU workers need no device).

    Raises ValueError when a rank does not see exactly one device, when two ranks of a replica share
    one, or when a replica spans nodes (the config keeps replicas within a node through
    resources.devices_per_node, but the placement group packs bundles, it does not pin them); that
    `generation_tp` divides the ranks the config's checks guarantee."""
    # the config's rollout checks have generation TP divide the actor ranks
    assert generation_tp >= 1 and len(ranks) % generation_tp == 0, f"TP {generation_tp} over {len(ranks)} ranks"
    if generation_tp == 1:
        return {}
    environments: dict[int, dict[str, str]] = {}
    for first in range(0, len(ranks), generation_tp):
        replica = ranks[first : first + generation_tp]
        kind = replica[0].device_kind
        if kind not in VISIBLE_DEVICES_ENVS:  # the CPU: nothing to hand over
            continue
        where = f"generation replica of actor ranks {first}..{first + generation_tp - 1}"
        if any(len(rank.device_ids) != 1 for rank in replica):
            raise ValueError(
                f"{where}: each actor rank must hold exactly one device id from Ray, they hold "
                f"{[list(rank.device_ids) for rank in replica]}; Ray assigns ids only for the "
                "accelerators it manages, so resources.accelerator_resource must be NPU on Ascend "
                f"or GPU on NVIDIA to use rollout.tensor_parallel_size {generation_tp} there"
            )
        devices = [rank.device_ids[0] for rank in replica]
        if len(set(devices)) != len(devices):
            raise ValueError(
                f"{where}: its ranks share devices {devices}; one engine's TP workers need distinct devices"
            )
        if len({rank.node_id for rank in replica}) != 1:
            raise ValueError(
                f"{where}: its ranks landed on several nodes, but one engine's TP workers run on "
                "its node; make rollout.tensor_parallel_size divide resources.devices_per_node "
                "and give the job whole nodes"
            )
        environments[first] = {VISIBLE_DEVICES_ENVS[kind]: ",".join(devices)}
    return environments
