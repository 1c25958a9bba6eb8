"""Which training backend a job runs, chosen once from `training`: the strategy's name and the
backend applied to the actor's plain model (the only place the layout is chosen)."""

from __future__ import annotations

from torch import nn

from rldock.config import JobConfig
from rldock.runtime.device import DeviceInfo
from rldock.runtime.training.backend import OptimizerFactory, TrainingBackend
from rldock.runtime.training.ddp import DdpBackend
from rldock.runtime.training.fsdp import FsdpBackend
from rldock.runtime.training.tensor_parallel import TensorParallelBackend

BACKENDS: dict[str, type[DdpBackend | FsdpBackend | TensorParallelBackend]] = {
    "ddp": DdpBackend,
    "fsdp": FsdpBackend,
    "tensor_parallel": TensorParallelBackend,
}


def strategy_of(cfg: JobConfig) -> str:
    """`fsdp` for `training.strategy: fsdp` (it runs its own allgather-swap); `tensor_parallel`
    for training TP > 1 or `training.resharding: allgather_swap` under DDP; else `ddp`."""
    training = cfg.training
    if training.strategy == "fsdp":
        return "fsdp"
    if training.tensor_parallel_size > 1 or training.resharding != "naive":
        return "tensor_parallel"
    return "ddp"


def build_backend(
    cfg: JobConfig,
    *,
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    device: DeviceInfo,
    rank: int,
    world_size: int,
) -> TrainingBackend:
    """Apply the job's strategy to `model` on this rank (collective: the default group must exist,
    and every rank calls this before the engine adopts the group)."""
    return BACKENDS[strategy_of(cfg)].build(
        cfg, model=model, make_optimizer=make_optimizer, device=device, rank=rank, world_size=world_size
    )
