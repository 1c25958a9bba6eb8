"""The resharding flow between the actor's update and generation stages.

`to_generation` (after an update):  1. allgather the TP shards into the temporary buffer;
2. load this rank's generation shard into the engine in place; 3. swap params, grads and optimizer
state to host; 4. free the buffer. `begin_update` (before the next update) brings the parameters
back at once, because the old-log-prob inference that comes first runs on them, and starts the
grads and optimizer state in the background so that their copy overlaps that inference (and the
reference inference); `finish_update_swap` waits for it right before the optimizer runs.

`naive` is the paper's Figure 3 baseline for comparison: steps 1 and 2 only, nothing swapped, the
buffer kept, so generation runs beside the whole training state.

Every boundary appends a ledger row (see `ledger`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal

import torch
from torch import nn

from rldock.contract.tensor_parallel import TP_PLANS
from rldock.runtime.resharding.gather import GatheredWeights, allgather_weights
from rldock.runtime.resharding.ledger import ledger_entry
from rldock.runtime.resharding.parallel_layout import ReshardPlan
from rldock.runtime.resharding.parallel_mesh import ParallelMesh
from rldock.runtime.resharding.shard import generation_items
from rldock.runtime.resharding.swap import SwapIn, TensorSwapper, make_storages_resizable, training_state

ReshardMode = Literal["allgather_swap", "naive"]
MODES = ("allgather_swap", "naive")

WeightLoader = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


class Resharder:
    """Moves one rank between its training and generation layouts (collective: all ranks call it)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        mesh: ParallelMesh,
        plan: ReshardPlan,
        rank: int,
        mode: ReshardMode,
        bucket_bytes: int,
        load_weights: WeightLoader,
        generation_tensors: Callable[[], Iterable[torch.Tensor]],
        kv_cache_bytes: Callable[[], int] = lambda: 0,
    ):
        assert mode in MODES, f"resharding mode {mode!r} is none of {MODES}"
        self.model, self.optimizer, self.mesh, self.plan = model, optimizer, mesh, plan
        self.mode, self.bucket_bytes = mode, bucket_bytes
        self.load_weights = load_weights
        self.generation_tensors, self.kv_cache_bytes = generation_tensors, kv_cache_bytes
        self.device = next(model.parameters()).device
        self.gen_tp_rank = plan.generate.tp_rank(rank)
        # The architecture's split table, for slicing the gathered weights (None: no plan, TP 1 only).
        config: Any = model.config
        self.tp_plan = TP_PLANS.get(config.model_type)
        self.swapper = TensorSwapper(pin_memory=self.device.type != "cpu")
        if mode == "allgather_swap":
            make_storages_resizable(model)
        self.gathered: GatheredWeights | None = None  # kept between stages in naive mode only
        self.ledger: list[dict] = []
        self._pending: SwapIn | None = None

    def record(self, stage: str) -> dict:
        tensors = dict(training_state(self.model, self.optimizer))
        tensors["generation_weights"] = list(self.generation_tensors())
        tensors["temp_buffer"] = list(self.gathered.buffers.values()) if self.gathered else []
        entry = ledger_entry(
            stage,
            tensors,
            device=self.device,
            kv_cache_bytes=self.kv_cache_bytes(),
            host_swap_bytes=self.swapper.swapped_bytes,
        )
        self.ledger.append(entry)
        return entry

    def to_generation(self) -> dict[str, float]:
        """Steps 1-4; returns seconds per step and the bytes swapped out."""
        self.record("update_end")
        if self.gathered is not None:  # naive mode: last iteration's buffer, replaced now
            self.gathered.free()
        train = self.plan.train
        tp_group = self.mesh.group("tp")
        timings: dict[str, float] = {}
        start = time.perf_counter()
        self.gathered = allgather_weights(
            self.model, tp_group=tp_group, tp_size=train.tp_size, bucket_bytes=self.bucket_bytes
        )
        timings["gather_s"] = _lap(start)
        start = time.perf_counter()
        self.load_weights(
            generation_items(
                self.gathered, tp_rank=self.gen_tp_rank, tp_size=self.plan.generate.tp_size, plan=self.tp_plan
            )
        )
        timings["load_s"] = _lap(start)
        self.record("resharded")
        if self.mode == "allgather_swap":
            start = time.perf_counter()
            timings["swap_out_bytes"] = self.swapper.swap_out(training_state(self.model, self.optimizer))
            timings["swap_out_s"] = _lap(start)
            start = time.perf_counter()
            self.gathered.free()
            self.gathered = None
            timings["free_s"] = _lap(start)
        self.record("generation")
        return timings

    def begin_update(self) -> dict[str, float]:
        """Before old-log-prob inference: params back now, grads and optimizer state in background."""
        timings: dict[str, float] = {}
        if self.mode == "allgather_swap":
            start = time.perf_counter()
            timings["swap_in_params_bytes"] = self.swapper.swap_in(["train_params"])
            timings["swap_in_params_s"] = _lap(start)
        # Recorded before the background copy starts, so the row is what inference begins with.
        self.record("inference")
        if self.mode == "allgather_swap":
            if self._pending is not None:  # two passes in a row (the run-ahead schedule's first): the first's copy
                self._pending.wait()
            self._pending = SwapIn(self.swapper, ["grads", "optimizer_state"], device=self.device)
        return timings

    def finish_update_swap(self) -> dict[str, float]:
        """Right before the optimizer: wait for the background swap-in; returns the wait."""
        timings: dict[str, float] = {}
        if self._pending is not None:
            start = time.perf_counter()
            timings["swap_in_rest_bytes"] = self._pending.wait()
            timings["swap_in_wait_s"] = _lap(start)
            self._pending = None
        self.record("update_start")
        return timings

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """The whole training state on the device for the block, then back as it was: for readers
        outside the stages (checkpoints), which must never see a swapped-out, empty storage. Writes
        no ledger row (not a stage boundary)."""
        if self._pending is not None:  # a background swap-in still copying: let it finish
            self._pending.wait()
            self._pending = None
        on_host = self.swapper.swapped()
        self.swapper.swap_in()
        try:
            yield
        finally:
            if on_host:
                self.swapper.swap_out(on_host)


def _lap(start: float) -> float:
    return time.perf_counter() - start
