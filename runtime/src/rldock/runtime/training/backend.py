"""The training backend protocol: how a trained model (the actor's policy, PPO's value model)
trains across its ranks.

One implementation per layout, chosen once from the config (`strategies.py`): DDP replicas
(`ddp.py`), FSDP2 shards (`fsdp.py`), a TP x DP mesh with resharding to generation
(`tensor_parallel.py`). A backend is applied from outside to the model its worker loaded (LoRA and
activation checkpointing already in place), after the default process group exists and, for the
actor, before the vLLM engine adopts it; the model object stays the worker's, sharded or wrapped in
place. A model with no engine (the critic's) never attaches one or exports its weights.

The workers' stages are then written once, whatever the layout: the backend says how the ranks
share a stage's samples, brings its training state back before a pass that needs it, defers or
applies gradient synchronisation, steps the optimizer, exports the weights to the engine after an
update and gathers what a checkpoint writes. Every method is called on all of the worker's ranks in
the same order (FSDP and TP's are collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from rldock.runtime.dock.stage_loop import StageFn, StageResult, StageSpec, run_stage

if TYPE_CHECKING:
    from rldock.runtime.dock import TransferDock
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.training.pipeline import PipelineStage

# (HF name, tensor) pairs as the engine loads them
WeightIter = Iterable[tuple[str, torch.Tensor]]
WeightPush = Callable[[WeightIter], object]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class TrainingBackend(Protocol):
    """One rank's share of the training layout."""

    model: nn.Module  # the worker's model object, sharded or split in place (DDP: the bare model)
    optimizer: torch.optim.Optimizer  # over the parameters as the layout holds them

    @property
    def pipeline(self) -> PipelineStage | None:
        """This rank's pipeline stage (FSDP under training.pipeline_parallel_size > 1; training/pipeline.py);
        None where the model runs whole."""
        ...

    @property
    def update_share(self) -> int:
        """Samples this rank's update consumes per iteration (its DP group's share)."""
        ...

    @property
    def counts_passes(self) -> bool:
        """Whether this rank's passes are its own work: False on a TP peer, which runs its leader's
        batches through its slice of the model, so the stage's FLOPs count the leader's passes only."""
        ...

    @property
    def writes_results(self) -> bool:
        """Whether this rank writes the inference stage's results to the dock: the reader of the ranks that
        run one forward together (`run_shared_stage`: a TP leader, a CP group's, the pipeline's last stage's);
        its peers run the same batches and write nothing, so what a rank measures of the results (the
        train-inference gap) is the writer's, once (a pipeline's earlier stages hold zeros, not logprobs)."""
        ...

    def training_module(self) -> nn.Module:
        """What the update's forward runs: the DDP wrapper, or the model sharded in place."""
        ...

    def accumulating(self, *, last: bool) -> AbstractContextManager:
        """Context for one micro-batch's forward and backward; gradients are synchronised across
        ranks on the `last` one only where the layout allows deferring it (DDP)."""
        ...

    def step(self, max_grad_norm: float) -> float:
        """Average where the layout has not yet, clip by the global norm, step; returns the norm."""
        ...

    def run_inference_stage(self, dock: TransferDock, spec: StageSpec, fn: StageFn) -> StageResult:
        """A no-grad pass over the model (old logprobs): the training state back first, the
        samples dealt as the layout's forward needs them."""
        ...

    def before_update(self) -> None:
        """The training state back on the device before the update touches a gradient, from where it
        is now: an inference pass may have brought it back, or not (none ran, or, in the run-ahead
        schedule, the next iteration's ran before the previous update, whose export moved it out again)."""
        ...

    def run_update_stage(
        self, dock: TransferDock, spec: StageSpec, fn: StageFn, *, whole_groups: bool = False
    ) -> StageResult:
        """Hand `fn` exactly this rank's share (`update_share`), token-balanced across DP ranks."""
        ...

    def attach_engine(self, engine: VllmRolloutEngine, local_weights: Callable[[], WeightIter]) -> None:
        """This rank's engine: where exported weights go, and what it reloads after a level-2 sleep."""
        ...

    def export_weights(self, push: WeightPush, local_weights: Callable[[], WeightIter]) -> dict[str, dict]:
        """After an update: the full weights into the engine (`push`, or the attached engine), the
        training state moved off the device where the layout swaps; returns the layout's metrics
        since the last call (ledger and resharding rows, none under DDP)."""
        ...

    def resident(self) -> AbstractContextManager:
        """Context: the whole training state on the device (for a checkpoint), put back after."""
        ...

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """The whole model's weights for rank 0's `save_pretrained` (collective where sharded);
        None where the model holds them whole already."""
        ...

    def save_optimizer(self, path: Path) -> None:
        """Write the optimizer state at `path` (and siblings where it stays sharded)."""
        ...

    def load_optimizer(self, path: Path, *, map_location: str) -> None:
        """Inverse of `save_optimizer`, each rank keeping its own part."""
        ...


def load_full_weights(backend: TrainingBackend, weights: Mapping[str, torch.Tensor]) -> None:
    """Inverse of `full_weights`: the whole model's tensors by state-dict name (every rank reads them
    whole) into the layout `backend` applied, each rank keeping its own part (torch's full state
    dict: whole tensors copied, DTensor shards cut from them; collective where sharded); a pipeline stage
    keeps its own layers' under its own names. The training state is brought onto the device first, as for
    a checkpoint's save."""
    if backend.pipeline is not None:
        weights = backend.pipeline.local_state(weights, held=backend.model.state_dict().keys())
    with backend.resident():
        set_model_state_dict(backend.model, dict(weights), options=StateDictOptions(full_state_dict=True))


def reload_after_sleep(engine: VllmRolloutEngine, local_weights: Callable[[], WeightIter]) -> None:
    """rollout.sleep_level 2 discards the engine's weights: it loads this rank's own again on waking."""

    def reload() -> None:  # memory.reload returns nothing; update_weights returns its seconds
        engine.update_weights(local_weights())

    engine.memory.reload = reload


def run_rank_share(
    dock: TransferDock,
    spec: StageSpec,
    fn: StageFn,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    whole_groups: bool = False,
) -> StageResult:
    """`run_stage` taking exactly one batch of `batch_size` as DP rank `rank` of `world_size`,
    token-balanced: the share of an update (DDP, FSDP) or of FSDP's collective forward."""
    return run_stage(
        dock,
        spec,
        fn,
        rank=rank,
        batch_size=batch_size,
        whole_groups=whole_groups,
        balance_ranks=world_size,
        max_batches=1,
    )


_END = None  # broadcast by a group's reader when its stage has no more batches


def run_shared_stage(
    dock: TransferDock,
    spec: StageSpec,
    fn: StageFn,
    *,
    group: dist.ProcessGroup | None,
    reader: int,
    dp_rank: int,
    batch_size: int,
    balance_ranks: int = 0,
    max_batches: int | None = None,
    whole_groups: bool = False,
) -> StageResult:
    """`run_stage` for ranks that compute one forward together and so must see the same samples (a
    TP group, a CP group): the group's `reader` (a global rank) reads from the dock as data-parallel
    rank `dp_rank` (token-balanced over `balance_ranks` ranks where > 0), broadcasts each batch to
    the group and alone writes the results back; every rank runs `fn` on the same batches in the
    same order. `group` None: this rank reads alone.

    Why one reader: the dock hands every sample to exactly one consumer, so every rank reading would
    hand different samples to the ranks of one forward, or (with a fan-out state in the dock) break
    the dock's exactly-once accounting that resume relies on. A batch is token ids and masks, small
    next to the forward they feed, so pickling it is fine."""

    def read(fn: StageFn) -> StageResult:
        return run_stage(
            dock,
            spec,
            fn,
            rank=dp_rank,
            batch_size=batch_size,
            whole_groups=whole_groups,
            balance_ranks=balance_ranks,
            max_batches=max_batches,
        )

    if group is None:
        return read(fn)

    def share(obj):
        box = [obj]
        dist.broadcast_object_list(box, src=reader, group=group)
        return box[0]

    if dist.get_rank() == reader:

        def shared(indices: torch.Tensor, batch):
            share((indices, batch))
            return fn(indices, batch)

        timing = read(shared)
        share(_END)
        return timing
    timing = StageResult()
    while (got := share(None)) is not _END:
        indices, batch = got
        fn(indices, batch)  # the reader writes the (identical) outputs
        timing.num_samples += len(indices)
    return timing
