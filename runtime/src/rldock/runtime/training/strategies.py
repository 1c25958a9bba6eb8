"""Which training backend a job runs, chosen once from `training`: the strategy's name and the
backend applied to a worker's plain model (the only place the layout is chosen). The actor's policy
takes the job's strategy (`strategy_of`); a model trained by data parallelism alone, PPO's value
model, takes its data-parallel part (`data_parallel_strategy_of`)."""

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


def data_parallel_strategy_of(cfg: JobConfig) -> str:
    """The layout of a model that trains over `training.data_parallel_size` ranks by data
    parallelism (and, under FSDP, the job's CP and pipeline stages) with no engine to reshard into
    (PPO's value model: TP plans split a causal LM's decoder, not a value head): `fsdp` for
    `training.strategy: fsdp`, else `ddp`, whatever training.tensor_parallel_size and
    training.resharding say of the policy."""
    return "fsdp" if cfg.training.strategy == "fsdp" else "ddp"


def build_backend(
    cfg: JobConfig,
    *,
    model: nn.Module,
    make_optimizer: OptimizerFactory,
    device: DeviceInfo,
    rank: int,
    world_size: int,
    data_parallel_only: bool = False,
    defer_gradient_sync: bool = False,
) -> TrainingBackend:
    """Apply the job's strategy to `model` on this rank (collective: the default group must exist,
    and every rank calls this before an engine adopts the group). `data_parallel_only`: its
    data-parallel part (`data_parallel_strategy_of`), for a model that is not the policy: the
    job's layout without TP.
    `defer_gradient_sync`: synchronise the micro-batches' gradients once per optimizer step where
    the layout would do it after each (FSDP; DDP and TP always defer it)."""
    strategy = data_parallel_strategy_of(cfg) if data_parallel_only else strategy_of(cfg)
    if data_parallel_only:  # its ranks are the stages' data-parallel (x CP) ones: no TP split of its layers
        cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"tensor_parallel_size": 1})})
    return BACKENDS[strategy].build(
        cfg,
        model=model,
        make_optimizer=make_optimizer,
        device=device,
        rank=rank,
        world_size=world_size,
        defer_gradient_sync=defer_gradient_sync,
    )
