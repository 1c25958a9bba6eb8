"""The TP x DP backend: the actor's tensor-parallel training layout and its resharding to
generation (one rank's view).

Used when `training.tensor_parallel_size` > 1 or `training.resharding` is `allgather_swap` (with
`strategy: ddp`); the default (TP 1, naive) is the DDP backend. The ranks form a (dp, tp) training mesh
(rank = dp_rank * tp_size + tp_rank; resharding/parallel_mesh.py); the policy is split with
`parallelize_decoder`; gradients are averaged over DP and clipped over the whole TP-split model by hand
(`resharding.parallelize`). Under `strategy: fsdp` TP composes with FSDP instead (training/fsdp.py).

Generation has its own layout (`rollout.tensor_parallel_size`, g): replicas of g consecutive ranks,
each with one vLLM engine on its first rank, which takes the full gathered weights (vLLM splits them
itself) and generates the replica's share of the prompts; at g = 1 every rank holds an engine.
Every rank still gathers and swaps: the allgather is collective over the training TP group, and the
swap frees each rank's own device. Training stages are different: the ranks of a
TP group compute one forward together and must see the same samples, so only the group's TP rank 0
(its "leader") reads from the dock, as DP rank `dp_rank` of `dp_size`, and broadcasts each batch to
its TP peers; it alone writes results back (backend.py's `run_shared_stage`, which says why).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rldock.config import JobConfig
from rldock.config.job_layout import job_layout
from rldock.runtime.device import DeviceInfo
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageFn, StageResult, StageSpec
from rldock.runtime.resharding.flow import Resharder
from rldock.runtime.resharding.ledger import ledger_metrics
from rldock.runtime.resharding.parallel_layout import ParallelLayout, ReshardPlan
from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh
from rldock.runtime.resharding.parallelize import apply_gradients, local_tensor, parallelize_decoder
from rldock.runtime.training.backend import OptimizerFactory, WeightIter, WeightPush, run_shared_stage

if TYPE_CHECKING:
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine

# Gather bucket per dtype: large enough that a tiny model needs a handful of collectives, small
# enough that one bucket of a 100M model is not a second copy of a layer group.
BUCKET_BYTES = 32 << 20


class TensorParallelBackend:
    """One actor rank's TP x DP layout, its TP-group data hand-off and its `Resharder`.

    Create after the default process group exists and before the vLLM engine adopts it (the mesh's
    sub-groups are formed collectively on every rank); then `attach_engine`.
    """

    pipeline: None = None  # the model runs whole (PP runs under FSDP)

    def __init__(
        self, cfg: JobConfig, *, model: nn.Module, make_optimizer: OptimizerFactory, rank: int, device_type: str
    ):
        training = cfg.training
        self.rank = rank
        self._micro_batch_size = training.micro_batch_size
        self._num_samples = cfg.num_samples_per_iteration
        layout = job_layout(cfg)  # the job's shape, computed once (rldock.contract.layout)
        self.train = ParallelLayout(tp_size=layout.tp, dp_size=layout.dp)
        # What each rank hands its engine: the full weights (TP 1 slices), whatever the generation TP,
        # since vLLM's loaders split them over the engine's own TP workers.
        plan = ReshardPlan(train=self.train, generate=ParallelLayout(tp_size=1, dp_size=layout.num_actor_ranks))
        self.mesh = ParallelMesh(MeshShape(dp=layout.dp, tp=layout.tp), device_type)
        self.model = parallelize_decoder(model, self.mesh)
        # Built after parallelizing: the plan replaces the split layers' Parameters by DTensor ones.
        self.optimizer = optimizer = make_optimizer(self.model.parameters())
        self.mode = training.resharding
        self._engine_load: WeightPush | None = None  # update_weights, whose seconds go unused
        self.resharder = Resharder(
            model=self.model,
            optimizer=optimizer,
            mesh=self.mesh,
            plan=plan,
            rank=rank,
            mode=self.mode,
            bucket_bytes=BUCKET_BYTES,
            load_weights=self._load,
            generation_tensors=list,
        )  # the vLLM engine reports no tensors (docs)
        self._tp_group = self.mesh.group("tp")
        self._leader = self.train.tp_group_ranks(rank)[0]
        self._times: dict[str, float] = {}  # resharding steps since the last drain_metrics

    # --- layout ---------------------------------------------------------------------------------

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
        defer_gradient_sync: bool = False,  # always deferred: `step` averages over DP once
    ) -> TensorParallelBackend:
        return cls(
            cfg,
            model=model,
            make_optimizer=make_optimizer,
            rank=rank,
            device_type=torch.device(device.torch_device).type,
        )

    # --- the training backend -------------------------------------------------------------------

    @property
    def update_share(self) -> int:
        return self._num_samples // self.dp_size

    @property
    def counts_passes(self) -> bool:
        return self.is_tp_leader  # the peers run the leader's batches (run_training_stage)

    @property
    def writes_results(self) -> bool:
        return self.is_tp_leader

    def training_module(self) -> nn.Module:
        return self.model

    def accumulating(self, *, last: bool) -> AbstractContextManager:
        return nullcontext()  # no DDP: `step` averages over DP

    def step(self, max_grad_norm: float) -> float:
        """Average over DP, clip over the TP-split model, step."""
        return apply_gradients(self.model, self.optimizer, self.mesh, max_grad_norm=max_grad_norm)

    def run_inference_stage(self, dock: TransferDock, spec: StageSpec, fn: StageFn) -> StageResult:
        self.begin_inference()  # the TP group computes together; its params come back first
        return self.run_training_stage(dock, spec, fn, batch_size=self._micro_batch_size)

    def before_update(self) -> None:
        # The params are on the host when no old-logprob pass brought them back since the last export: none
        # ran, or the run-ahead schedule ran this iteration's before the previous update.
        if self.resharder.swapper.holds("train_params"):
            self.begin_inference()
        self._times.update(self.resharder.finish_update_swap())  # before any gradient is touched

    def run_update_stage(
        self, dock: TransferDock, spec: StageSpec, fn: StageFn, *, whole_groups: bool = False
    ) -> StageResult:
        return self.run_training_stage(
            dock,
            spec,
            fn,
            batch_size=self.update_share,
            balance=True,
            max_batches=1,
            whole_groups=whole_groups,
        )

    def attach_engine(self, engine: VllmRolloutEngine, local_weights: Callable[[], WeightIter]) -> None:
        self._engine_load = engine.update_weights  # what the resharder loads after each update

    def export_weights(self, push: WeightPush, local_weights: Callable[[], WeightIter]) -> dict[str, dict]:
        """Reshard into the attached engine (and swap the training state out in allgather_swap
        mode); `push` is unused: the gathered weights go to the engine only on ranks holding one."""
        self._times.update(self.resharder.to_generation())
        return self.drain_metrics()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Full (unsplit) weights by HF name; collective over the TP group (call on every rank)."""
        return {
            name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            for name, tensor in self.model.state_dict().items()
        }

    def save_optimizer(self, path: Path) -> None:
        """Every rank of DP replica 0 writes its TP shard (`optimizer_path`)."""
        if self.dp_rank == 0:
            torch.save(self.optimizer_state(), self.optimizer_path(path))

    def load_optimizer(self, path: Path, *, map_location: str) -> None:
        self.load_optimizer_state(torch.load(self.optimizer_path(path), map_location=map_location))

    # --- layout ---------------------------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        return self.train.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.train.dp_size

    @property
    def is_tp_leader(self) -> bool:
        return self.rank == self._leader

    def _load(self, items) -> None:
        if self._engine_load is not None:  # DPO-like recipes run no engine
            self._engine_load(items)

    # --- training stages: the TP group reads once and shares ----------------------------------

    def run_training_stage(
        self,
        dock: TransferDock,
        spec: StageSpec,
        fn: StageFn,
        *,
        batch_size: int,
        balance: bool = False,
        max_batches: int | None = None,
        whole_groups: bool = False,
    ) -> StageResult:
        """`run_stage` for a stage that runs the TP-split model: the TP leader reads (as DP rank
        `dp_rank`) and writes; every TP rank runs `fn` on the same batches, in the same order."""
        return run_shared_stage(
            dock,
            spec,
            fn,
            group=self._tp_group,
            reader=self._leader,
            dp_rank=self.dp_rank,
            batch_size=batch_size,
            balance_ranks=self.dp_size if balance else 0,
            max_batches=max_batches,
            whole_groups=whole_groups,
        )

    # --- the update cycle -----------------------------------------------------------------------

    def begin_inference(self) -> None:
        """Start of the old-log-prob stage: params back now, grads and optimizer state in background."""
        self._times.update(self.resharder.begin_update())

    def drain_metrics(self) -> dict[str, dict]:
        """Since the last call: the ledger rows (`memory/rank{r}/{stage}/{category}`, bytes) and
        the resharding steps' seconds and bytes (`rank{r}/{step}`) and whether the rank holds an
        engine (`rank{r}/holds_engine`), for the iteration's record."""
        rows, self.resharder.ledger = self.resharder.ledger, []
        times, self._times = self._times, {}
        times["holds_engine"] = float(self._engine_load is not None)  # 0 on a generation TP peer
        return {
            "ledger": ledger_metrics(rows, rank=self.rank),
            "resharding": {f"rank{self.rank}/{key}": value for key, value in times.items()},
        }

    # --- checkpoints ----------------------------------------------------------------------------

    def resident(self) -> AbstractContextManager:
        """Context: the whole training state on the device (for a checkpoint), swapped back after."""
        return self.resharder.resident()

    def optimizer_state(self) -> dict:
        """This rank's optimizer state with DTensors as their local shards, for `torch.save`."""
        state = self.optimizer.state_dict()
        # New dicts: state_dict() shares the per-parameter dicts with the live optimizer.
        state["state"] = {
            index: {
                key: local_tensor(value) if isinstance(value, torch.Tensor) else value
                for key, value in per_param.items()
            }
            for index, per_param in state["state"].items()
        }
        return state

    def load_optimizer_state(self, state: dict) -> None:
        """Inverse of `optimizer_state`: local shards back into DTensors placed like their parameters.

        Every tensor is copied first: storages read by `torch.load` cannot be resized, so the swap
        could not free them (and `load_state_dict` keeps some, such as AdamW's `step`, as they are).
        """
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        for index, per_param in state["state"].items():
            param = params[index]
            for key, value in per_param.items():
                if not isinstance(value, torch.Tensor):
                    continue
                value = value.clone()
                if isinstance(param, DTensor) and value.shape == param.to_local().shape:
                    value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False)
                per_param[key] = value
        self.optimizer.load_state_dict(state)

    def optimizer_path(self, path: Path) -> Path:
        """Where this rank's optimizer shard lives beside the checkpoint's optimizer file: TP rank 0
        uses the file itself (so TP 1 checkpoints are the usual ones), TP rank r a `.tp{r}` sibling."""
        tp_rank = self.train.tp_rank(self.rank)
        return path if tp_rank == 0 else path.with_name(f"{path.stem}.tp{tp_rank}{path.suffix}")
