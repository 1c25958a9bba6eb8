"""The update's router terms for an MoE model: each micro-batch's routing recorded, its load-balancing loss
(Hugging Face's, models/moe.py `balance_loss`) weighted into the micro-batch's loss, and the expert load
reported, the same whether the model runs whole, over CP ranks or cut into pipeline stages.

The loss is E * sum_e f_e P_e over every layer's real tokens at once, a product of two sums, so neither a
CP rank's slice of the positions nor a pipeline stage's run of the layers has a loss of its own to add:
what adds is the sums (`RouterTotals`). A CP group sums them (models/moe.py). Under pipeline parallelism
(training/pipeline.py) a stage's routers are routers `first_router`... of the whole model's `num_routers`;
each micro-batch's activations carry the totals of the stages so far (`StageLinks.carry`), each stage adds
its own, and the last stage takes the loss from the whole model's totals, as one process would. The loss's
gradient with respect to the carried probabilities' sum goes back with the activations' gradient, so each
stage's routers get their part (the counts are the top-k's choice and carry none). Expert parallelism
changes nothing here: the router runs on every rank over all E experts for the rank's own tokens (only the
experts' weights are split), so the totals are a data-parallel rank's, as without EP.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from rldock.runtime.models.context_group import context_group
from rldock.runtime.models.moe import (
    RouterRecord,
    RouterTotals,
    balance_loss,
    expert_load,
    expert_load_metrics,
    is_moe,
    moe_shape,
    record_routing,
    router_totals,
    totals_width,
)
from rldock.runtime.models.pipeline_stage import pipeline_links


def router_carry_width(model: nn.Module, *, num_routers: int) -> int:
    """What a pipeline stage of `model` (the whole model's `num_routers` routers) carries beside its
    activations: the router totals' length, 0 for a dense model."""
    shape = moe_shape(getattr(model, "config", None))
    return totals_width(num_routers=num_routers, num_experts=shape.num_experts) if shape and num_routers else 0


class RouterLoss:
    """The router terms of one model's update (module docstring): record a micro-batch's routing, add the
    weighted auxiliary loss to its loss and report the load. `coef` None takes the model config's
    router_aux_loss_coef. For a dense model every method leaves things as they are."""

    def __init__(self, model: nn.Module, *, coef: float | None):
        shape = moe_shape(getattr(model, "config", None))
        self.stage = pipeline_links(model)
        # a stage whose layers have no router still passes the earlier stages' totals on
        routed = is_moe(model) or (self.stage is not None and self.stage.num_routers > 0)
        self.shape = shape if shape is not None and routed else None
        self.coef = (coef if coef is not None else shape.router_aux_loss_coef) if shape is not None else 0.0
        self.group = context_group(model)  # CP: the totals summed over the group

    @contextmanager
    def recording(self, module: nn.Module) -> Iterator[RouterRecord | None]:
        if self.shape is None:
            yield None
            return
        with record_routing(module) as record:
            yield record

    def add(
        self, loss: Tensor, metrics: dict[str, float], record: RouterRecord | None, *, share: float
    ) -> tuple[Tensor, dict[str, float]]:
        """`loss` plus coef x the auxiliary loss x `share` (the micro-batch's part of the step, so the
        step's sum is the mini-batch's mean); the metrics likewise weighted, as accumulate sums them. On a
        pipeline stage before the last: its totals passed on, `loss` and `metrics` as they are (the last
        stage's are the step's)."""
        if self.shape is None or record is None or not record.logits:
            return loss, metrics
        totals = self._totals(record)
        if totals is None:
            return loss, metrics
        totals = totals.summed_over(self.group)
        aux = balance_loss(totals)
        metrics = dict(metrics)
        metrics["moe/aux_loss"] = float(aux.detach()) * share
        metrics |= {key: value * share for key, value in expert_load_metrics(expert_load(totals)).items()}
        if self.coef:
            loss = loss + self.coef * share * aux.to(loss.dtype)
        return loss, metrics

    def _totals(self, record: RouterRecord) -> RouterTotals | None:
        """The whole model's totals of the micro-batch: the record's own, or under pipeline parallelism the
        stages' so far plus this stage's, None on a stage before the last (which passes them on)."""
        assert self.shape is not None
        experts, top_k, stage = self.shape.num_experts, self.shape.top_k, self.stage
        if stage is None:
            return router_totals(record, num_experts=experts, top_k=top_k)
        if record.num_layers:
            part = router_totals(
                record, num_experts=experts, top_k=top_k, first_router=stage.first_router, num_routers=stage.num_routers
            ).flat()
        else:
            part = torch.zeros(stage.carry_width, dtype=stage.carry_dtype, device=stage.device)
        carried = stage.carry(part)
        if not stage.last:
            return None
        return RouterTotals.from_flat(carried, num_routers=stage.num_routers, num_experts=experts)
