"""Routing replay (R3, "rollout routing replay", arXiv 2510.11370): one forward pass records the experts
each MoE router chose for every token, a later pass over the same samples routes by them.

The record is a grid over the batch's tokens: `routed_experts` (B, PL + SL, layers, top_k) int16, the
prompt columns then the response columns as the dock holds them (columns.ROUTED_EXPERTS), -1 where
no pass computed a token (padding). A pass does not see that grid's layout: it is trimmed to its own
columns, or packed (each shared prompt once, engines/packing.py), so the caller says before each
forward where its tokens sit in the grid (`PassCells`, from engines/policy.py's pass plans).

Hooks on each router (models/moe.py's `routers`, in layer order):
- `RoutingRecord` copies the router's chosen experts of the pass's real tokens into the grid.
- `RoutingReplay` replaces them by the grid's, and the router's weights by its scores of the replayed
  experts as the router weights its own choice (`GateScoring`: softmax probabilities, renormalised over
  them where the router normalises its top-k, Qwen3-MoE's norm_topk_prob, Mixtral always; DeepSeek-V3's
  sigmoid scores, renormalised and scaled), as R3 does: the experts are fixed, the gate still weights them,
  so the router's gradient flows through those probabilities. Under expert parallelism the dispatch
  (engines/expert_parallel.py) reads the replayed experts, so tokens go where the record says.
  Tokens the grid has no record of (-1) keep the router's own choice.

The replaying hooks run before models/moe.py's `record_routing` hooks when installed first, so the
auxiliary loss and the expert-load metrics count the experts the pass actually used.

Under context parallelism (engines/ulysses.py) a pass's router sees this CP rank's slice of the
positions only, so the pass gives the hooks the cells of its own tokens (`PassCells.on_positions`):
a rank replays its own tokens' routing, and records only them, the CP group's records then merged
(`RoutingRecord.routed_experts`: every cell was computed by exactly one rank of the group).

Under pipeline parallelism (models/pipeline_stage.py) a stage holds a run of the layers, so its routers
are a run of the grid's layer columns (`StageLinks.first_router` on, of `num_routers`): a stage replays
and records those columns only, and the stages' records are merged over the pipeline group as the CP
ranks' are (each (cell, layer) is computed by exactly one stage of one CP rank). A stage of dense layers
has no router and records nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rldock.runtime.flow import columns
from rldock.runtime.models.context_group import context_group
from rldock.runtime.models.moe import moe_shape, routers
from rldock.runtime.models.pass_cells import PassCells, PassListener
from rldock.runtime.models.pipeline_stage import pipeline_links

NO_EXPERT = -1  # a grid cell no pass computed
(ROUTED_EXPERTS,) = columns.ROUTED_EXPERTS  # the dock's column


@dataclass(frozen=True)
class PassListeners:
    """Several listeners told the same (routing replay's hooks and the router loss's record)."""

    listeners: tuple[PassListener, ...]

    def begin_pass(self, cells: PassCells) -> None:
        for listener in self.listeners:
            listener.begin_pass(cells)


def pass_listeners(*listeners: PassListener | None) -> PassListener | None:
    """The listeners given (None where none is)."""
    present = tuple(listener for listener in listeners if listener is not None)
    return PassListeners(present) if present else None


def padded_pass_cells(rows: Tensor, *, prompt_start: int, attention_mask: Tensor, row_width: int) -> PassCells:
    """The cells of a pass over padded rows (engines/policy.py's `micro_batch_inputs`): batch rows
    `rows` (b,), grid columns [prompt_start, prompt_start + n) for the pass's n columns (the kept
    prompt columns, then the response's), `attention_mask` (b, n) 1 on its real tokens, grid rows
    `row_width` = PL + SL wide."""
    b, n = attention_mask.shape
    device = attention_mask.device
    cells = rows.to(device)[:, None] * row_width + prompt_start + torch.arange(n, device=device)[None]  # (b, n)
    real = attention_mask.bool().reshape(-1)
    return PassCells(cells=cells.reshape(-1)[real], tokens=torch.arange(b * n, device=device)[real])


def packed_pass_cells(rows: Tensor, local_cells: PassCells, *, row_width: int) -> PassCells:
    """A packed pass's cells (engines/packing.py's `PackedPass.cells`, whose cells count the pass's
    own rows 0..b-1) in the batch's grid: pass row i is batch row rows[i]."""
    local_row, column = local_cells.cells // row_width, local_cells.cells % row_width
    return PassCells(cells=rows.to(local_row.device)[local_row] * row_width + column, tokens=local_cells.tokens)


class RouterHooks:
    """The per-pass state both hooks share: the current pass's cells and the grid (rows * (PL+SL), layers, k)."""

    def __init__(self, grid: Tensor):
        self.grid = grid
        self.cells: PassCells | None = None

    def begin_pass(self, cells: PassCells) -> None:
        """Say where the next forward pass's tokens sit in the grid (before calling the model)."""
        self.cells = cells

    def _pass_cells(self, num_tokens: int) -> PassCells:
        if self.cells is None:
            raise RuntimeError("routing replay: a forward pass ran without begin_pass (the pass's token cells)")
        assert self.cells.tokens.numel() == 0 or int(self.cells.tokens.max()) < num_tokens, "another pass's cells"
        return self.cells


class RoutingRecord(RouterHooks):
    """Records the experts chosen in passes over a batch of `num_rows` rows, `row_width` = PL + SL
    columns wide; `routed_experts()` is the dock's column."""

    def __init__(
        self,
        *,
        num_rows: int,
        row_width: int,
        num_layers: int,
        top_k: int,
        groups: tuple[dist.ProcessGroup, ...] = (),
        device: torch.device | None = None,
    ):
        super().__init__(torch.full((num_rows * row_width, num_layers, top_k), NO_EXPERT, dtype=torch.int16))
        self.shape = (num_rows, row_width, num_layers, top_k)
        # the CP group and the pipeline group whose ranks record the batch's slices (module docstring)
        self.groups = groups
        self.device = device or torch.device("cpu")  # the routers' (where the groups' collectives run)

    def hook(self, layer: int):
        def after_router(_gate, _args, output):
            _logits, _weights, indices = output  # indices (T, k)
            cells = self._pass_cells(indices.shape[0])
            self.device = indices.device
            self.grid[cells.cells.cpu(), layer] = indices[cells.tokens].to("cpu", torch.int16)

        return after_router

    def routed_experts(self) -> Tensor:
        """The record (B, PL+SL, layers, k) int16; under CP and PP merged over their groups (collective:
        every rank of them calls this): a cell one rank recorded is NO_EXPERT (-1) on the others, so the max."""
        if not self.groups:
            return self.grid.reshape(self.shape)
        merged = self.grid.to(self.device, torch.int32)  # gloo reduces no int16
        for group in self.groups:
            dist.all_reduce(merged, op=dist.ReduceOp.MAX, group=group)
        return merged.to("cpu", torch.int16).reshape(self.shape)


class RoutingReplay(RouterHooks):
    """Routes passes over a batch by its recorded `routed_experts` (B, PL + SL, layers, k). Counts, over
    the real tokens it replays, how many (token, layer) routings differ from the router's own top-k
    (`drift`): what replay changes in these passes."""

    def __init__(self, routed_experts: Tensor):
        rows, width, layers, top_k = routed_experts.shape
        super().__init__(routed_experts.reshape(rows * width, layers, top_k))
        self.replayed = 0  # (token, layer) routings taken from the record
        self.changed = 0  # of those, the ones whose expert set differs from the router's own top-k

    def hook(self, layer: int, *, scoring: GateScoring):
        def after_router(_gate, _args, output):
            logits, weights, indices = output  # (T, E), (T, k), (T, k)
            cells = self._pass_cells(indices.shape[0])
            recorded = self.grid[cells.cells.cpu(), layer].to(indices.device, torch.int64)  # (C, k)
            known = (recorded != NO_EXPERT).all(dim=-1)  # (C,)
            tokens, recorded = cells.tokens[known], recorded[known]
            chosen = indices.clone()
            chosen[tokens] = recorded
            own, replay = indices[tokens].sort(dim=-1).values, recorded.sort(dim=-1).values
            self.replayed += int(tokens.numel())
            self.changed += int((own != replay).any(dim=-1).sum())
            return logits, gate_weights(logits, chosen, scoring=scoring).to(weights.dtype), chosen

        return after_router

    def metrics(self) -> dict[str, float]:
        """`moe/routing_replay_changed`: the share of the replayed (token, layer) routings whose experts
        differ from those the router would choose now."""
        return {"moe/routing_replay_changed": self.changed / max(self.replayed, 1)}


@dataclass(frozen=True)
class GateScoring:
    """How a router weights the experts it chose: Qwen's and Mixtral's softmax over all experts' logits,
    renormalised over the chosen where `normalise` (Mixtral always, Qwen3-MoE by norm_topk_prob);
    DeepSeek-V3's sigmoid of each expert's logit (the correction bias only chooses, it never weights),
    renormalised by norm_topk_prob, then times routed_scaling_factor."""

    sigmoid: bool = False
    normalise: bool = True
    scale: float = 1.0

    @staticmethod
    def of(gate: nn.Module) -> GateScoring:
        deepseek = hasattr(gate, "e_score_correction_bias")
        return GateScoring(
            sigmoid=deepseek,
            normalise=bool(getattr(gate, "norm_topk_prob", True)),
            scale=float(getattr(gate, "routed_scaling_factor", 1.0)) if deepseek else 1.0,
        )


def gate_weights(logits: Tensor, chosen: Tensor, *, scoring: GateScoring) -> Tensor:
    """(T, k) weights of the `chosen` (T, k) experts from the router's `logits` (T, E), as the router weights its
    own choice (`GateScoring`), differentiable in the logits."""
    scores = torch.sigmoid(logits.float()) if scoring.sigmoid else torch.softmax(logits.float(), dim=-1)
    weights = scores.gather(-1, chosen)
    if scoring.normalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if scoring.sigmoid else 0.0))
    return weights * scoring.scale


def _router_columns(model: nn.Module) -> tuple[int, int]:
    """The grid's layer column of `model`'s first router, and the whole model's router count (a pipeline
    stage's routers are a run of them: module docstring)."""
    stage = pipeline_links(model)
    if stage is not None:
        return stage.first_router, stage.num_routers
    return 0, len(routers(model))


@contextmanager
def _hooked(model: nn.Module, hooks: RouterHooks, install) -> Iterator[RouterHooks]:
    first, total = _router_columns(model)
    if not total:
        raise ValueError(
            "algorithm.routing_replay needs an MoE model (Qwen3-MoE, Mixtral, DeepSeek-V3); the model has no routers"
        )
    handles = [install(first + i, gate) for i, gate in enumerate(routers(model))]
    try:
        yield hooks
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def recording_routes(model: nn.Module, *, num_rows: int, row_width: int) -> Iterator[RoutingRecord]:
    """Record the routing of `model`'s passes over a batch of `num_rows` rows of PL + SL = `row_width`
    tokens (module docstring)."""
    shape = moe_shape(getattr(model, "config", None))
    if shape is None:
        raise ValueError("algorithm.routing_replay needs an MoE model (Qwen3-MoE, Mixtral, DeepSeek-V3); set it off")
    # a layer count from the routers themselves: a model may keep dense MLPs in some layers
    stage = pipeline_links(model)
    record = RoutingRecord(
        num_rows=num_rows,
        row_width=row_width,
        num_layers=_router_columns(model)[1],
        top_k=shape.top_k,
        groups=tuple(g for g in (context_group(model), None if stage is None else stage.group) if g is not None),
        device=None if stage is None else stage.device,
    )
    with _hooked(model, record, lambda layer, gate: gate.register_forward_hook(record.hook(layer))):
        yield record


@contextmanager
def replaying_routes(model: nn.Module, routed_experts: Tensor) -> Iterator[RoutingReplay]:
    """Route `model`'s passes over a batch by its `routed_experts` (B, PL + SL, layers, k) (module docstring)."""
    replay = RoutingReplay(routed_experts)

    def install(layer: int, gate: nn.Module):
        return gate.register_forward_hook(replay.hook(layer, scoring=GateScoring.of(gate)))

    with _hooked(model, replay, install):
        yield replay


@contextmanager
def replaying_batch(model: nn.Module, batch) -> Iterator[RoutingReplay | None]:
    """`replaying_routes` by the batch's `routed_experts` column (a TensorDict's), or nothing (None)
    where the batch has none (algorithm.routing_replay off)."""
    if ROUTED_EXPERTS not in batch.keys():
        yield None
        return
    with replaying_routes(model, batch[ROUTED_EXPERTS]) as replay:
        yield replay
