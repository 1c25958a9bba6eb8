"""The ranks that train one model (the actor's policy, PPO's value model) as one torch.distributed
group: rank 0 opens the rendezvous (`pick_rendezvous`), then every rank joins at once and applies
the job's training backend to its model (`join`, strategies.py's `build_backend`). Until it joins,
a rank trains the bare model as a world of one (`alone`)."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed import TCPStore

from rldock.config import JobConfig
from rldock.runtime.device import DeviceInfo
from rldock.runtime.engines.process_group import Rendezvous, init_process_group, open_rendezvous
from rldock.runtime.training.backend import OptimizerFactory, TrainingBackend
from rldock.runtime.training.ddp import DdpBackend
from rldock.runtime.training.strategies import build_backend


class TrainingGroup:
    """One rank's membership: rank `rank` of `world_size` on `device`."""

    def __init__(self, cfg: JobConfig, *, device: DeviceInfo, rank: int, world_size: int):
        self.cfg, self.device, self.rank, self.world_size = cfg, device, rank, world_size
        self._store: TCPStore | None = None  # rank 0's listening store, from pick_rendezvous

    def alone(self, model: nn.Module, make_optimizer: OptimizerFactory) -> TrainingBackend:
        """The bare model and its optimizer, a world of one until `join` applies the job's layout."""
        optimizer = make_optimizer(model.parameters())
        return DdpBackend(self.cfg, model=model, optimizer=optimizer, rank=self.rank, world_size=self.world_size)

    def pick_rendezvous(self) -> Rendezvous:
        """On rank 0: open the group's store here; every rank's `join` gets its address."""
        rendezvous, self._store = open_rendezvous(self.world_size)
        return rendezvous

    def form(self, rendezvous: Rendezvous) -> None:
        """Join the default process group (all ranks at once), no backend applied: what a group that
        trains nothing needs (the reference's CP groups, workers/reference.py)."""
        init_process_group(
            self.device, rank=self.rank, world_size=self.world_size, rendezvous=rendezvous, store=self._store
        )

    def join(
        self, rendezvous: Rendezvous, model: nn.Module, make_optimizer: OptimizerFactory, **options: Any
    ) -> TrainingBackend:
        """Form the group (all ranks at once) and apply the job's backend to `model`, the optimizer
        built on the parameters as the layout holds them; `options` go to `build_backend`. Collective
        (a TP mesh's sub-groups, FSDP's mesh), so before a vLLM engine adopts the group."""
        self.form(rendezvous)
        rank, world_size, device = self.rank, self.world_size, self.device
        return build_backend(
            self.cfg,
            model=model,
            make_optimizer=make_optimizer,
            device=device,
            rank=rank,
            world_size=world_size,
            **options,
        )
