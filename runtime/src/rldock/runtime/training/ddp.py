"""The DDP backend (`training.strategy: ddp`, TP 1, resharding naive): every rank holds the whole
model, DDP averages gradients during the last micro-batch's backward, and after an update each rank
pushes its own (identical) weights into its engine in memory, with no cross-rank transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from rldock.config import JobConfig
from rldock.runtime.device import DeviceInfo
from rldock.runtime.dock.stage_loop import StageFn, StageResult, StageSpec, run_stage
from rldock.runtime.engines.process_group import wrap_ddp
from rldock.runtime.training.backend import OptimizerFactory, WeightIter, WeightPush, reload_after_sleep, run_rank_share

if TYPE_CHECKING:
    from rldock.runtime.dock import TransferDock
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine


class DdpBackend:
    """One DDP rank. `ddp_model` None: a world of one that runs the bare model (an actor that has
    not joined a group, as the single-process tests build it; a lone critic rank, which never does)."""

    pipeline: None = None  # the model runs whole (PP runs under FSDP)

    def __init__(
        self,
        cfg: JobConfig,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        rank: int,
        world_size: int,
        ddp_model: DistributedDataParallel | None = None,
    ):
        self.model, self.optimizer, self.ddp_model = model, optimizer, ddp_model
        self.rank, self.world_size = rank, world_size
        self._micro_batch_size = cfg.training.micro_batch_size
        self._share = cfg.num_samples_per_iteration // world_size

    @classmethod
    def build(
        cls,
        cfg: JobConfig,
        *,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        device: DeviceInfo,
        rank: int,
        world_size: int,
        defer_gradient_sync: bool = False,  # DDP always defers it to the last micro-batch (`accumulating`)
    ) -> DdpBackend:
        return cls(
            cfg,
            model=model,
            optimizer=make_optimizer(model.parameters()),
            rank=rank,
            world_size=world_size,
            ddp_model=wrap_ddp(model, device),
        )

    @property
    def update_share(self) -> int:
        return self._share

    @property
    def counts_passes(self) -> bool:
        return True  # every rank computes its own share

    @property
    def writes_results(self) -> bool:
        return True  # every rank reads and writes its own share

    def training_module(self) -> nn.Module:
        return self.ddp_model if self.ddp_model is not None else self.model

    def accumulating(self, *, last: bool) -> AbstractContextManager:
        # Only the last micro-batch's backward all-reduces; the others add to the local gradients.
        return torch.enable_grad() if last or self.ddp_model is None else self.ddp_model.no_sync()

    def step(self, max_grad_norm: float) -> float:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_grad_norm))
        self.optimizer.step()
        return grad_norm

    def run_inference_stage(self, dock: TransferDock, spec: StageSpec, fn: StageFn) -> StageResult:
        # Each rank's forward is its own: micro-batches as they come, no share to balance.
        return run_stage(dock, spec, fn, rank=self.rank, batch_size=self._micro_batch_size)

    def before_update(self) -> None:
        pass  # nothing leaves the device

    def run_update_stage(
        self, dock: TransferDock, spec: StageSpec, fn: StageFn, *, whole_groups: bool = False
    ) -> StageResult:
        return run_rank_share(
            dock,
            spec,
            fn,
            rank=self.rank,
            world_size=self.world_size,
            batch_size=self._share,
            whole_groups=whole_groups,
        )

    def attach_engine(self, engine: VllmRolloutEngine, local_weights: Callable[[], WeightIter]) -> None:
        reload_after_sleep(engine, local_weights)

    def export_weights(self, push: WeightPush, local_weights: Callable[[], WeightIter]) -> dict[str, dict]:
        push(local_weights())
        return {}

    def resident(self) -> AbstractContextManager:
        return nullcontext()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        return None

    def save_optimizer(self, path: Path) -> None:
        if self.rank == 0:  # every rank's state is the same
            torch.save(self.optimizer.state_dict(), path)

    def load_optimizer(self, path: Path, *, map_location: str) -> None:
        self.optimizer.load_state_dict(torch.load(path, map_location=map_location))
