"""Forming a torch.distributed group across Ray actor ranks, and wrapping the actor model in DDP.

Ray starts the actors; torch.distributed needs every rank to agree on a rendezvous address. Rank 0
opens one (`open_rendezvous`: the group's store, listening on its node), the driver hands the
address to all ranks, and each calls `init_process_group` with the backend of its `DeviceInfo`
(hccl / nccl / gloo), rank 0 with the store it opened.

Ordering with the in-process vLLM engine: vLLM reuses the default process group if one exists and
otherwise creates a world of one for itself, after which no other default group can be created.
So a data-parallel actor that also hosts a rollout engine must join the trainer group first and
create the engine afterwards, on all ranks at once: vLLM then forms its own sub-groups of the
adopted world, which is collective. Checked on CPU with two Ray actors (gloo); the engines then
generate independently. An engine's `shutdown` destroys the adopted group too (see
`rldock.runtime.engines.vllm_rollout`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rldock.runtime.device import DeviceInfo
from rldock.runtime.resharding.parallel_mesh import DEFAULT_GROUP_TIMEOUT_S

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0 listens for the group's TCP store."""

    address: str
    port: int

    @property
    def init_method(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address  # IPv6 literal
        return f"tcp://{host}:{self.port}"


def open_rendezvous(world_size: int, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> tuple[Rendezvous, dist.TCPStore]:
    """Run on rank 0: the group's store, listening on this node's Ray address, and where it listens.

    The store binds a port the OS picks and keeps it: picking a free port and binding it later
    let another process take it in between (EADDRINUSE at `init_process_group`, seen under load).
    Rank 0 passes the store to `init_process_group`; the other ranks connect to the address.
    """
    import ray

    address = ray.util.get_node_ip_address()
    store = dist.TCPStore(
        address, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return Rendezvous(address=address, port=store.port), store


def init_process_group(
    device: DeviceInfo,
    *,
    rank: int,
    world_size: int,
    rendezvous: Rendezvous,
    store: dist.TCPStore | None = None,
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
) -> None:
    """Make this rank's device the current one, then join the default process group with the
    device's collective backend.

    `store`: on rank 0, the one `open_rendezvous` opened; otherwise this rank connects to (or, as
    rank 0 without one, listens at) `rendezvous`.

    The current device matters beyond DDP's `device_ids`: FSDP2 and its device mesh place shards on
    it (a model on npu:1 is otherwise sharded onto npu:0), and HCCL/NCCL bind their communicators
    to it. With one visible device per actor it is index 0 either way.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process (a vLLM engine created "
            "before the trainer group takes the default group); join the group first"
        )
    if device.is_accelerator:
        torch.get_device_module(device.kind).set_device(device.device_index)
    logger.info("rank %d/%d joining %s group at %s", rank, world_size, device.backend, rendezvous.init_method)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(
            rendezvous.address,
            rendezvous.port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
    dist.init_process_group(
        backend=device.backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_ddp(model: nn.Module, device: DeviceInfo) -> DistributedDataParallel:
    """Wrap `model` (already on `device.torch_device`) for gradient averaging across ranks.

    device_ids names the single accelerator this rank drives; on CPU it must stay None. No buffer is
    broadcast before each forward (DDP's default broadcasts rank 0's, one collective a forward): every rank
    loads the same checkpoint, and nothing trains a language model's buffers (rotary frequencies, a
    router's correction bias), so the broadcast would copy equal values; on the CPU it cost a device
    worker about 1.4 ms of every fixed-cost iteration (a py-spy profile).
    """
    device_ids = [device.device_index] if device.is_accelerator else None
    return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)
