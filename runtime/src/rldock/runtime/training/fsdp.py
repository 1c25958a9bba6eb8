"""The FSDP2 backend (`training.strategy: fsdp`): sharding, the weight push into the engine, the
swap of the shards around generation, the ledger and checkpoints of sharded state.

Every method here is collective over the worker's ranks (FSDP all-gathers and reduce-scatters), so
the worker calls them on all ranks in the same order, as it does its update. So is the forward:
an inference stage hands every rank its equal share in one pass, as the update does. With
`training.context_parallel_size` > 1 the ranks are dp x cp and a share is a data-parallel rank's:
its CP group's first rank reads it and every rank of the group computes a slice of each sequence
(training/context_parallel.py). With `training.tensor_parallel_size` > 1 the decoder layers' linears are
split over TP groups first (resharding/parallelize.py) and FSDP shards those shards over the dp x cp
ranks: a data-parallel rank's rows are its cp x tp ranks', read once by the first of them.

Gradients are reduce-scattered after every micro-batch's backward, so a rank holds only gradient
shards; with `defer_gradient_sync` the micro-batches accumulate whole gradients unsynchronised and
the last backward reduce-scatters them once per optimizer step (fewer collectives, each parameter's
whole gradient on the device in between: the PPO critic's choice, which its memory plan counts).

With `training.resharding: allgather_swap` the flow after an update is allgather-swap from the
FSDP layout: the shards are all-gathered one tensor at a time into the engine's layout (whole
tensors, TP 1) and loaded, then this rank's parameter shards, gradients and AdamW state are
swapped to the host (resharding/swap.py) until the next training pass needs them. With `naive`
they stay on the device. The ledger rows (`memory/rank{r}/{stage}/...`) record what the device
holds at each step, as the TP x DP path's do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.fsdp import FSDPModule

from rldock.config import JobConfig
from rldock.runtime.device import DeviceInfo
from rldock.runtime.dock.stage_loop import StageFn, StageResult, StageSpec
from rldock.runtime.engines.expert_parallel import gather_expert_state, gather_experts, shard_expert_state
from rldock.runtime.engines.fsdp_sharding import COMPUTE_DTYPES, apply_fsdp, clip_grad_norm, full_state_dict
from rldock.runtime.resharding.ledger import ledger_entry, ledger_metrics
from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh
from rldock.runtime.resharding.parallelize import parallelize_decoder, sum_partial_gradients
from rldock.runtime.resharding.swap import TensorSwapper, training_state
from rldock.runtime.training.backend import OptimizerFactory, WeightIter, WeightPush, reload_after_sleep
from rldock.runtime.training.context_parallel import ContextLayout
from rldock.runtime.training.pipeline import split_stage

if TYPE_CHECKING:
    from rldock.runtime.dock import TransferDock
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine

logger = logging.getLogger(__name__)

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class FsdpBackend:
    """One rank's FSDP2-sharded model and optimizer. Create after the default group exists and
    before an engine adopts it; the optimizer is built here, on the sharded parameters."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        model: nn.Module,
        make_optimizer: OptimizerFactory,
        device: DeviceInfo,
        rank: int,
        defer_gradient_sync: bool = False,
    ):
        training = cfg.training
        cp, tp, pp = training.context_parallel_size, training.tensor_parallel_size, training.pipeline_parallel_size
        # The group's mesh: pp stages of dp x cp x tp ranks (CP inside data parallelism, TP innermost), EP carved
        # out of the dp x cp ranks (rldock.contract.layout); all its groups made here, on every rank alike.
        self.mesh = mesh = ParallelMesh(
            MeshShape(
                dp=dist.get_world_size() // (pp * cp * tp),
                cp=cp,
                tp=tp,
                ep=training.expert_parallel_size,
                replicate=training.data_parallel_replicate_size,
                pp=pp,
            ),
            torch.device(device.torch_device).type,
        )
        self.experts = mesh.experts
        # In torchtitan's order: the model cut to this rank's pipeline stage, TP's plan on its decoder layers,
        # the CP attention, then FSDP over the stage's sequence ranks, which shards the TP shards again (2-D
        # DTensors on one root mesh).
        activations = COMPUTE_DTYPES[training.mixed_precision] or next(model.parameters()).dtype
        self.pipeline = split_stage(model, mesh, dtype=activations, device=torch.device(device.torch_device))
        parallelize_decoder(model, mesh)
        self.context = ContextLayout.of(model, mesh=mesh, mode=training.context_parallel_mode)
        self.model = apply_fsdp(
            model, device, mesh, cpu_offload=training.fsdp_cpu_offload, mixed_precision=training.mixed_precision
        )
        self.context.sum_gradients(self.model)
        self.optimizer = make_optimizer(self.model.parameters())
        self.rank = rank
        self.world_size = dist.get_world_size()
        self._share = cfg.num_samples_per_iteration // self.context.dp  # a CP group's ranks share their rows
        self.swaps = training.resharding == "allgather_swap"
        self._device = torch.device(device.torch_device)
        self._swapper = TensorSwapper(pin_memory=device.is_accelerator)
        self._ledger: list[dict] = []
        self.defer_gradient_sync = defer_gradient_sync

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
        defer_gradient_sync: bool = False,
    ) -> FsdpBackend:
        return cls(
            cfg,
            model=model,
            make_optimizer=make_optimizer,
            device=device,
            rank=rank,
            defer_gradient_sync=defer_gradient_sync,
        )

    # --- the training backend -------------------------------------------------------------------

    @property
    def update_share(self) -> int:
        return self._share

    @property
    def counts_passes(self) -> bool:
        # Every rank computes its own share (a CP rank's tally counts its slice of each pass); a TP peer
        # runs its data-parallel rank's passes through its slice of the layers: the first of the pair counts;
        # a pipeline's stages run one pass between them: the last, which scores it, counts.
        return self.mesh.local_rank("tp") == 0 and (self.pipeline is None or self.pipeline.last)

    @property
    def writes_results(self) -> bool:
        return self.context.reader == dist.get_rank()

    def training_module(self) -> nn.Module:
        return self.model

    def accumulating(self, *, last: bool) -> AbstractContextManager:
        if self.defer_gradient_sync:  # only the last backward reduce-scatters (module docstring)
            cast(FSDPModule, self.model).set_requires_gradient_sync(last)  # apply_fsdp made it one in place
        return nullcontext()

    def step(self, max_grad_norm: float) -> float:
        grad_norm = self.clip_gradients(max_grad_norm)
        self.optimizer.step()
        return grad_norm

    def run_inference_stage(self, dock: TransferDock, spec: StageSpec, fn: StageFn) -> StageResult:
        self.to_training()
        return self.context.run_share(dock, spec, fn, batch_size=self._share)

    def before_update(self) -> None:
        self.to_training()

    def run_update_stage(
        self, dock: TransferDock, spec: StageSpec, fn: StageFn, *, whole_groups: bool = False
    ) -> StageResult:
        return self.context.run_share(dock, spec, fn, batch_size=self._share, whole_groups=whole_groups)

    def attach_engine(self, engine: VllmRolloutEngine, local_weights: Callable[[], WeightIter]) -> None:
        # This rank's local state dict, not the gathered one: the reload runs on the engine rank alone.
        reload_after_sleep(engine, local_weights)

    def export_weights(self, push: WeightPush, local_weights: Callable[[], WeightIter]) -> dict[str, dict]:
        self.to_generation(push)  # collective: every rank gathers
        return self.drain_metrics()

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on the host (collective), for save_pretrained on rank 0."""
        return {name: tensor.cpu() for name, tensor in self.full_state()}

    def save_optimizer(self, path: Path) -> None:
        """Gathered whole (collective), so the checkpoint has the same file as a DDP run's. Call
        inside `resident`: on CPU the gathered state can share the swapped tensors."""
        state = self.full_optimizer_state()
        if self.rank == 0:
            torch.save(state, path)

    def load_optimizer(self, path: Path, *, map_location: str) -> None:
        self.load_optimizer_state(path)  # every rank reads the whole file on the host

    # --- the layout's steps ---------------------------------------------------------------------

    def clip_gradients(self, max_norm: float) -> float:
        # Under TP, the replicated per-head modules' gradients are partial sums per TP rank: complete them
        # (FSDP has reduced them over the sequence ranks already) before the norm.
        # Under PP a tied model's embedding (first stage) and head (last) sum their gradients, and the stages'
        # squares add up to the whole model's norm, the tied tensor counted once.
        sum_partial_gradients(self.model, self.mesh)
        if self.pipeline is None:
            return clip_grad_norm(self.model, max_norm, experts=self.experts)
        self.pipeline.sum_tied_gradients(self.model)
        return clip_grad_norm(
            self.model,
            max_norm,
            experts=self.experts,
            stages=self.pipeline.links.group,
            counted_elsewhere=self.pipeline.counted_elsewhere(self.model),
        )

    def to_generation(self, update_weights: WeightPush) -> None:
        """After an update: gather the full weights into the engine, then (allgather_swap) move the
        training state to the host."""
        self._record("after_update")
        update_weights(self.full_state())
        if self.swaps:
            self._swapper.swap_out(training_state(self.model, self.optimizer))
        self._record("generation")

    def full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model's (name, tensor) in the Hugging Face layout, one at a time (collective):
        FSDP's shards all-gathered, then expert shards gathered over the EP group."""
        weights = full_state_dict(self.model)
        if self.experts is not None:
            weights = gather_experts(weights, self.experts.sharding)
        if self.pipeline is not None:  # every stage's tensors on every rank (training/pipeline.py)
            weights = self.pipeline.whole_state(weights)
        return weights

    def to_training(self) -> None:
        """Before a pass that runs the model: bring swapped-out training state back."""
        if self._swapper.swapped_bytes:
            self._swapper.swap_in()

    @contextmanager
    def resident(self):
        """The training state on the device for a checkpoint, and back where it was after."""
        was_swapped = bool(self._swapper.swapped_bytes)
        self.to_training()
        try:
            yield
        finally:
            if was_swapped:
                self._swapper.swap_out(training_state(self.model, self.optimizer))

    def drain_metrics(self) -> dict[str, dict]:
        """Since the last call: the ledger rows, as `memory/rank{r}/{stage}/{category}` bytes."""
        rows, self._ledger = self._ledger, []
        return {"ledger": ledger_metrics(rows, rank=self.rank)}

    def _record(self, stage: str) -> None:
        state = training_state(self.model, self.optimizer)
        self._ledger.append(
            ledger_entry(stage, state, device=self._device, host_swap_bytes=self._swapper.swapped_bytes)
        )

    # --- checkpoints ----------------------------------------------------------------------------

    def full_optimizer_state(self) -> dict:
        """The optimizer state keyed by parameter names, gathered whole on the host (collective).
        With expert parallelism every rank gathers its experts' state (not rank 0 alone) and the EP
        group gathers the experts, and under PP rank 0 gathers every stage's, so the file is one
        process's whatever the layout."""
        if self.experts is None and self.pipeline is None:
            return get_optimizer_state_dict(self.model, self.optimizer, options=FULL)
        # Every rank gathers (FULL's offload leaves it on global rank 0 alone, which holds one stage)
        state: dict[str, Any] = dict(
            get_optimizer_state_dict(self.model, self.optimizer, options=StateDictOptions(full_state_dict=True))
        )
        if self.experts is not None:
            state = gather_expert_state(state, self.experts.sharding)
        state = {
            **state,
            "state": {name: {k: _on_host(v) for k, v in values.items()} for name, values in state["state"].items()},
        }
        return state if self.pipeline is None else self.pipeline.whole_optimizer_state(state)

    def load_optimizer_state(self, path: Path) -> None:
        """Every rank reads the whole file and keeps its own shards (and, under EP, its experts; under PP,
        its stage's)."""
        state = torch.load(path, map_location="cpu")
        if self.pipeline is not None:
            state = self.pipeline.local_optimizer_state(state, held={n for n, _ in self.model.named_parameters()})
        if self.experts is not None:
            state = shard_expert_state(state, self.experts.sharding)
        with self.resident():
            set_optimizer_state_dict(
                self.model, self.optimizer, optim_state_dict=state, options=StateDictOptions(full_state_dict=True)
            )
        # Plain tensors kept from the file (AdamW's step counters) have storages the swap cannot free.
        for per_param in self.optimizer.state.values():
            for key, value in per_param.items():
                if type(value) is torch.Tensor and not value.untyped_storage().resizable():
                    per_param[key] = value.clone()


def _on_host(value):
    return value.cpu() if isinstance(value, torch.Tensor) else value
