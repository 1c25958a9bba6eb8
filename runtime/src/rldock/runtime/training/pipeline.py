"""Pipeline parallelism (`training.pipeline_parallel_size`): the decoder layers split into stages, one per
pipeline rank, and the update's micro-batches run through them on a 1F1B schedule.

The split (`split_stage`, before TP's plan and FSDP): a stage keeps its run of layers (`stage_layers`: as
even as the count allows, the spare layers on the first stages, since the last holds the LM head) and drops
the rest; the first keeps the embedding, the last the final norm and the head, and the stage boundaries
become `StageInput` / `StageOutput` (models/pipeline_stage.py's `cut_stage`, which needs no group). A rank
never holds the whole model: it knows its stage from its rank (`rank_stage`), and the workers load only that
stage's weights (models/loading.py, the skeleton cut by the same `cut_stage` before a tensor is read), so
`split_stage` finds the model cut and links its placeholders to the pipeline group. The model stays a
Hugging Face model running its own forward, so every pass (packed, padded, trimmed, under TP) runs on every
stage unchanged; a stage's parameter names are its own (`model.layers.0` is its first layer), and
`StageNames` maps them to the whole model's. A model whose embedding and head share one tensor (tied,
SmolLM2's) gets a copy on the last stage; the two stages sum their gradients (`sum_tied_gradients`), so
both copies take the same steps.

The schedule (`run_one_forward_one_backward`, PipeDream-flush's 1F1B as Megatron runs it): stage s of p
runs min(p - s - 1, m) forwards first, then alternates one forward and one backward, then the remaining
backwards, so a stage holds at most p - s micro-batches' activations (GPipe's all-forwards-first would hold
all m) and the bubble is (p - 1) / (m + p - 1) of the step. The micro-batches are the update's own (cut from
the token budget, engines/policy_passes.py), every stage cutting the same ones from the same rows. The loss
and its metrics are the last stage's; the others run the same loss function on zeros (engines/policy.py)
and their metrics are replaced by the last stage's. An MoE's router loss, a product of sums over every
layer, is the last stage's too: each micro-batch's activations carry the stages' router totals so far
(models/router_loss.py), and its gradient comes back with theirs to each stage's routers.

Why not torch.distributed.pipelining: its stages pass fixed-shape tensors between stages (shapes
inferred once, or declared), while the update's packed micro-batches differ in length pass by pass;
here each stage knows a pass's shape from the rows it holds, as every pass already does.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rldock.runtime.models.pipeline_stage import (
    StageInput,
    StageLinks,
    StageNames,
    StageOutput,
    cut_stage,
    pipeline_links,
    receive_all,
    stage_parts,
)
from rldock.runtime.models.router_loss import router_carry_width
from rldock.runtime.resharding.parallel_mesh import ParallelMesh

if TYPE_CHECKING:
    from rldock.config.training import TrainingSpec

# micro-batch -> (its loss, its metrics): training/accumulation.py's MicroLoss
MicroLoss = Callable[[Any], tuple[Tensor, dict[str, float]]]


class PipelineStage:
    """This rank's stage: its links to the other stages, the names of its parameters in the whole model,
    and, in a tied model, the name of the tensor its first and last stages both hold (the embedding there,
    the head here; looked up on the model each time, since FSDP replaces its parameters)."""

    def __init__(self, links: StageLinks, names: StageNames, tied: str | None, tied_group) -> None:
        self.links, self.names, self.tied, self.tied_group = links, names, tied, tied_group

    @property
    def last(self) -> bool:
        return self.links.last

    @torch.no_grad()
    def sum_tied_gradients(self, model: nn.Module) -> None:
        """A tied model: the embedding's gradient on the first stage plus the head's on the last, on both
        (after the update's last backward; FSDP's shards line up, the two stages' meshes being alike)."""
        if self.tied is None or not (tied := model.get_parameter(self.tied)).requires_grad:
            return  # untied, or frozen on both stages (training.freeze_embeddings)
        grad = tied.grad
        assert grad is not None, f"{self.tied} has no gradient after the update's backward"
        dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.tied_group)

    def counted_elsewhere(self, model: nn.Module) -> set[int]:
        """The parameters (by id) the whole model's gradient norm counts on another stage: the last stage's
        copy of a tied tensor."""
        return {id(model.get_parameter(self.tied))} if self.tied is not None and self.last else set()

    def whole_state(self, local: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """The whole model's (name, tensor), one at a time, on every stage (collective over the pipeline
        group): each stage's `local` tensors (as its ranks gather them: FSDP's shards and the experts whole)
        broadcast from it in stage order, each after its name, shape and dtype, so a stage learns the
        others' as they come (expert parallelism's gather changes their shapes). Each rank's peers in the
        other stages send it theirs."""
        links = self.links
        ranks = dist.get_process_group_ranks(links.group)
        for stage in range(links.size):
            while True:
                item = next(local, None) if stage == links.index else None
                box: list[Any] = [None if item is None else (self.names.whole(item[0]), item[1].shape, item[1].dtype)]
                dist.broadcast_object_list(box, src=ranks[stage], group=links.group)
                if box[0] is None:  # the stage has sent all its tensors
                    break
                name, shape, dtype = box[0]
                if item is not None:
                    tensor = item[1].to(links.device).contiguous()
                else:
                    tensor = torch.empty(shape, dtype=dtype, device=links.device)
                dist.broadcast(tensor, src=ranks[stage], group=links.group)
                yield name, tensor

    def whole_optimizer_state(self, state: dict) -> dict:
        """This stage's optimizer state (torch's full state dict: by parameter name, on every rank) and the
        other stages' merged under the whole model's names on global rank 0, which writes it (collective over
        rank 0's pipeline group; {} elsewhere). A tied model's head copy is left out: it took the embedding's
        gradients and steps, so the file is one process's."""
        group = self.links.group
        ranks = dist.get_process_group_ranks(group)
        if 0 not in ranks:
            return {}
        skip = self.tied if self.tied is not None and self.last else None
        mine = {
            "state": {self.names.whole(n): v for n, v in state["state"].items() if n != skip},
            "param_groups": [
                {**g, "params": [self.names.whole(n) for n in g["params"] if n != skip]} for g in state["param_groups"]
            ],
        }
        every: list[Any] | None = [None] * self.links.size if dist.get_rank() == 0 else None
        dist.gather_object(mine, every, dst=0, group=group)
        if every is None:
            return {}
        merged = {"state": {}, "param_groups": [{**g, "params": []} for g in every[0]["param_groups"]]}
        for part in every:
            merged["state"] |= part["state"]
            for into, group_of_part in zip(merged["param_groups"], part["param_groups"]):
                into["params"] += group_of_part["params"]
        return merged

    def local_state(self, weights: Mapping[str, Tensor], held: Collection[str]) -> dict[str, Tensor]:
        """Inverse of `whole_state` on this stage, whose state dict's names are `held`: the whole model's tensors
        it holds, under its own names (a tied model's last stage gives its head the embedding's)."""
        named = ((self.names.local(name), tensor) for name, tensor in weights.items())
        local = {mine: tensor for mine, tensor in named if mine is not None and mine in held}
        if self.tied is not None and self.last:
            local[self.tied] = weights[f"{self.names.decoder}.embed_tokens.weight"]
        return local

    def local_optimizer_state(self, state: dict, held: Collection[str]) -> dict:
        """Inverse of `whole_optimizer_state` on this stage, whose parameters are named `held`: their entries
        under those names (a tied model's last stage gives its head the embedding's)."""
        pairs = [(local, name) for name in state["state"] if (local := self.names.local(name)) in held]
        if self.tied is not None and self.last:
            pairs.append((self.tied, f"{self.names.decoder}.embed_tokens.weight"))
        return {
            "state": {local: state["state"][name] for local, name in pairs},
            "param_groups": [
                {**g, "params": [local for name in g["params"] for local, kept in pairs if kept == name]}
                for g in state["param_groups"]
            ],
        }


def split_stage(
    model: nn.Module, mesh: ParallelMesh, *, dtype: torch.dtype, device: torch.device
) -> PipelineStage | None:
    """Cut `model` (a Hugging Face causal LM, whole or already cut to this stage by the stage loader) to this
    rank's stage of `mesh`'s `pp` dimension, in place (models/pipeline_stage.py's `cut_stage`), and link its
    placeholders to the pipeline group (module docstring); None at pp 1. Collective: every rank calls it (the
    tied stages' groups)."""
    size = mesh.size("pp")
    if size == 1:
        return None
    index, group = mesh.local_rank("pp"), mesh.group("pp")
    assert group is not None
    ranks = dist.get_process_group_ranks(group)
    cut = cut_stage(model, index=index, size=size)
    parts = stage_parts(model)
    links = StageLinks(
        index=index,
        size=size,
        group=group,
        previous=ranks[index - 1] if index > 0 else None,
        next=ranks[index + 1] if index < size - 1 else None,
        hidden_size=getattr(model, parts.decoder).config.hidden_size,
        dtype=dtype,
        device=device,
        first_router=cut.first_router,
        num_routers=cut.num_routers,
        carry_width=router_carry_width(model, num_routers=cut.num_routers),
    )
    for module in model.modules():
        if isinstance(module, StageInput | StageOutput):
            module.links = links
    # Each (first, last) pair of a tied model sums its gradients; every rank makes every pair's group, in order.
    tied_group = None
    if cut.tied:
        for pipeline in mesh.shape.rank_groups("pp"):
            pair = dist.new_group([pipeline[0], pipeline[-1]])
            if dist.get_rank() in (pipeline[0], pipeline[-1]):
                tied_group = pair
    tied = None
    if cut.tied and cut.last:
        tied = f"{parts.head}.weight"
    elif cut.tied and index == 0:
        tied = f"{parts.decoder}.embed_tokens.weight"
    return PipelineStage(links, StageNames(cut.layers, decoder=parts.decoder), tied, tied_group)


def rank_stage(training: TrainingSpec, *, rank: int, world_size: int) -> tuple[int, int] | None:
    """(stage, stages) of rank `rank` of a group of `world_size` laid out pp outermost (rldock.contract.layout:
    stage s holds the s-th block of world_size / stages ranks), known before any group forms (the stage
    loader's, models/loading.py); None at training.pipeline_parallel_size 1."""
    stages = training.pipeline_parallel_size
    if stages == 1:
        return None
    assert world_size % stages == 0, f"{world_size} ranks do not split into {stages} pipeline stages"
    return rank // (world_size // stages), stages


def run_one_forward_one_backward(
    model: nn.Module,
    micro_batches: Sequence[Any],
    micro_loss: MicroLoss,
    accumulating: Callable[..., AbstractContextManager],
) -> dict[str, float]:
    """Every micro-batch's forward and backward through this rank's stage of `model` in 1F1B order (module
    docstring), gradients accumulated (`accumulating(last=)` around each backward: FSDP syncs on the last);
    returns the last stage's metrics summed over the micro-batches, on every stage."""
    links = pipeline_links(model)
    assert links is not None
    m, warmup = len(micro_batches), min(links.size - links.index - 1, len(micro_batches))
    losses: list[Tensor | None] = []
    stats: dict[str, float] = {}
    pending: list[dist.Work] = []  # sends in flight, waited before the schedule returns

    def forward(i: int) -> None:
        loss, metrics = micro_loss(micro_batches[i])
        losses.append(loss)
        for key, value in metrics.items():
            stats[key] = stats.get(key, 0.0) + value

    def send_output(i: int, *, then_receive: int | None = None) -> list[Tensor] | None:
        """Send micro-batch i's activations (and the vector they carry) on; with `then_receive`, receive that
        micro-batch's gradients in the same batch of operations (module docstring of models/pipeline_stage.py)."""
        ops = [dist.P2POp(dist.isend, t.detach().contiguous(), links.next, links.group) for t in links.outgoing(i)]
        grads = None
        if then_receive is not None:
            grads = [torch.empty_like(t) for t in links.outgoing(then_receive)]
            ops += [dist.P2POp(dist.irecv, grad, links.next, links.group) for grad in grads]
        works = dist.batch_isend_irecv(ops)
        if grads is None:
            pending.extend(works)
        else:
            for work in works:
                work.wait()
        return grads

    def receive_gradients(k: int) -> list[Tensor]:
        grads = [torch.empty_like(t) for t in links.outgoing(k)]
        assert links.next is not None
        receive_all(grads, src=links.next, group=links.group)
        return grads

    def backward(k: int, grads: list[Tensor] | None) -> None:
        with accumulating(last=k == m - 1):
            if links.last:
                loss = losses[k]
                assert loss is not None
                loss.backward()
            else:
                assert grads is not None
                # a carried vector no loss term reached (zeros: `StageLinks.emit`) has no graph to go back through
                sent = [(t, g) for t, g in zip(links.outgoing(k), grads, strict=True) if t.requires_grad]
                torch.autograd.backward([t for t, _ in sent], [g for _, g in sent])
        if not links.first:
            back = [t.grad if t.grad is not None else torch.zeros_like(t) for t in links.incoming(k)]
            ops = [dist.P2POp(dist.isend, grad, links.previous, links.group) for grad in back]
            pending.extend(dist.batch_isend_irecv(ops))
        losses[k] = None  # the activations go with the graph
        if not links.last:
            links.outputs[k] = links.outputs[k].detach()
            if links.carry_width:
                links.carried_out[k] = links.carried_out[k].detach()
        if not links.first:
            links.inputs[k] = links.inputs[k].detach()
            if links.carry_width:
                links.carried_in[k] = links.carried_in[k].detach()

    links.scheduled, links.inputs, links.outputs, links.carried_in, links.carried_out = True, [], [], [], []
    try:
        for i in range(warmup):
            forward(i)
            if not links.last:
                send_output(i)
        for k in range(m - warmup):
            forward(warmup + k)
            grads = None if links.last else send_output(warmup + k, then_receive=k)
            backward(k, grads)
        for k in range(m - warmup, m):
            backward(k, receive_gradients(k))
        for work in pending:
            work.wait()
    finally:
        links.scheduled, links.inputs, links.outputs, links.carried_in, links.carried_out = False, [], [], [], []
    box = [stats]
    dist.broadcast_object_list(box, src=dist.get_process_group_ranks(links.group)[-1], group=links.group)
    return box[0]
