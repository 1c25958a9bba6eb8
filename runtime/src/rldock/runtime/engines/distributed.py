"""Forming a torch.distributed group across Ray actor ranks, and wrapping the actor model in DDP.

Ray starts the actors; torch.distributed needs every rank to agree on a rendezvous address. Rank 0
picks one (`pick_rendezvous`) on its own node, the driver hands it to all ranks, and each calls
`init_process_group` with the backend of its `DeviceInfo` (hccl / nccl / gloo).

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
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rldock.runtime.device import DeviceInfo

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


def pick_rendezvous() -> Rendezvous:
    """Run on rank 0: this node's Ray address and a port that is free right now.

    The port is released before the store binds it, so another process could take it in between;
    the window is short and a clash fails loudly at `init_process_group`, not silently.
    """
    import ray

    address = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        port = sock.getsockname()[1]
    return Rendezvous(address=address, port=port)


def init_process_group(
    device: DeviceInfo,
    *,
    rank: int,
    world_size: int,
    rendezvous: Rendezvous,
    timeout_s: float = 300.0,
) -> None:
    """Make this rank's device the current one, then join the default process group with the
    device's collective backend.

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
    logger.info(
        "rank %d/%d joining %s group at %s", rank, world_size, device.backend, rendezvous.init_method
    )
    dist.init_process_group(
        backend=device.backend,
        init_method=rendezvous.init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap_ddp(model: nn.Module, device: DeviceInfo) -> DistributedDataParallel:
    """Wrap `model` (already on `device.torch_device`) for gradient averaging across ranks.

    device_ids names the single accelerator this rank drives; on CPU it must stay None.
    """
    device_ids = [device.device_index] if device.is_accelerator else None
    return DistributedDataParallel(model, device_ids=device_ids)


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average `tensor` over the group in place (for metrics); returns it."""
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.div_(dist.get_world_size())
