"""A pipeline stage as the model's own modules know it (training.pipeline_parallel_size; training/pipeline.py
splits the model): on a stage after the first, the embedding is a `StageInput` that hands the forward the
previous stage's activations; on a stage before the last, the final norm is a `StageOutput` that passes the
stage's activations on, and the LM head is gone. The passes (engines/policy.py) find the stage here, as they
find the CP group in context_group.py: below the engines, so that models/ never imports engines/.

The cut (`cut_stage`) is here too, apart from the pipeline group: it needs only the stage's place, which a
rank knows from its rank before any group forms, so the loader (models/loading.py) cuts a model's skeleton
before reading its weights and a stage reads only its own; training/pipeline.py's `split_stage` cuts a
whole model the same way (the same function) and then links the placeholders to the pipeline group.

Two ways activations move, one per kind of pass:
- streaming (a pass without gradients: old logprobs, the reference): a forward receives its input when it
  needs it (a blocking receive from the previous stage) and sends its output as soon as it has it (a
  blocking send: data flows one way, so nothing waits in a circle), and stage s computes pass i while
  stage s + 1 computes pass i - 1;
- scheduled (the update): the forward still receives its input, but its output is kept for the schedule
  (training/pipeline.py, 1F1B), which sends it together with the receive of a gradient, as one batch of
  point-to-point operations (Megatron's send_forward_recv_backward: posted one at a time, a send to the
  next stage and that stage's send back would each wait for the other's receive on HCCL and NCCL).

A scheduled pass may carry a vector beside its activations (`StageLinks.carry_width`; an MoE's router
totals, models/router_loss.py): each stage adds its part to what it received (`StageLinks.carry`) and
passes the sum on, so the last stage holds the whole model's; the vector's gradient comes back with the
activations' and reaches each stage's part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rldock.contract.layout import stage_layer_counts
from rldock.runtime.models.moe import routers


def receive_all(tensors: list[Tensor], *, src: int, group: dist.ProcessGroup) -> None:
    """Receive `tensors` from global rank `src`, in the order it posted its sends: one as a plain receive, more
    as one batch of point-to-point operations (as they were sent; NCCL and HCCL then match them as a group)."""
    if len(tensors) == 1:
        dist.recv(tensors[0], src=src, group=group)
        return
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, tensor, src, group) for tensor in tensors]):
        work.wait()


@dataclass
class StageLinks:
    """Stage `index` of `size`: its pipeline group (this rank's peers in the other stages), the global ranks
    of the stages before and after it (None at the ends), and the activations' width and dtype. An MoE's
    routers are numbered over the whole model (routing replay's grid has a column per router): the stage's
    first is router `first_router` of `num_routers`. `inputs` and `outputs` keep a scheduled pass's
    activations (in forward order) for its backward, `carried_in` and `carried_out` the vector of
    `carry_width` it carries beside them (module docstring; 0: none)."""

    index: int
    size: int
    group: dist.ProcessGroup
    previous: int | None
    next: int | None
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    first_router: int = 0
    num_routers: int = 0
    carry_width: int = 0
    scheduled: bool = False
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    carried_in: list[Tensor] = field(default_factory=list)
    carried_out: list[Tensor] = field(default_factory=list)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        """The last stage scores: it holds the final norm and the LM head."""
        return self.index == self.size - 1

    @property
    def carry_dtype(self) -> torch.dtype:
        """The carried vector's: at least float32 (counts in bf16 would round above 256)."""
        return torch.promote_types(self.dtype, torch.float32)

    def receive(self, tokens: torch.Size) -> Tensor:
        """The previous stage's activations (*tokens, H) for this forward (and, in a scheduled pass, the vector
        it carries, kept in `carried_in`); leaves that record their gradient when the forward does."""
        assert self.previous is not None
        hidden = torch.empty((*tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        received = [hidden]
        if self.scheduled and self.carry_width:
            received.append(torch.empty(self.carry_width, dtype=self.carry_dtype, device=self.device))
        receive_all(received, src=self.previous, group=self.group)
        for tensor in received:
            tensor.requires_grad_(torch.is_grad_enabled())
        if self.scheduled:
            self.inputs.append(hidden)
            self.carried_in.extend(received[1:])
        return hidden

    def emit(self, hidden: Tensor) -> None:
        """This stage's activations: kept for the schedule (with zeros to carry until `carry` says otherwise), or
        sent on at once (module docstring)."""
        if self.scheduled:
            self.outputs.append(hidden)
            if self.carry_width:
                self.carried_out.append(torch.zeros(self.carry_width, dtype=self.carry_dtype, device=self.device))
            return
        assert self.next is not None
        dist.send(hidden.detach().contiguous(), dst=self.next, group=self.group)

    def carry(self, part: Tensor) -> Tensor:
        """The vector the scheduled pass just run carries (`carry_width`,): this stage's `part` plus what the
        earlier stages' passed on with its input, which a stage before the last passes on in turn. Returns the
        sum, with its graph back to the received vector (whose gradient goes back to the earlier stages)."""
        assert self.scheduled and part.shape == (self.carry_width,), "a stage carries a vector in the update's schedule"
        total = part if self.first else self.carried_in[-1].to(part.dtype) + part
        if not self.last:
            self.carried_out[-1] = total.to(self.carry_dtype)
        return total

    def outgoing(self, i: int) -> list[Tensor]:
        """What scheduled pass i sends on: its activations, and the vector it carries."""
        return [self.outputs[i], *([self.carried_out[i]] if self.carry_width else [])]

    def incoming(self, i: int) -> list[Tensor]:
        """What scheduled pass i received (`outgoing`'s leaves on the next stage)."""
        return [self.inputs[i], *([self.carried_in[i]] if self.carry_width else [])]


@dataclass(frozen=True)
class StageCut:
    """Stage `index` of `size` as cut from a whole model: the whole model's `layers` it holds, where its routers
    sit among the whole model's (routing replay's grid: its first is `first_router` of `num_routers`), and
    whether the whole model's embedding and head are one tensor (`tied`: the last stage's head is a copy)."""

    index: int
    size: int
    layers: range
    first_router: int
    num_routers: int
    tied: bool

    @property
    def last(self) -> bool:
        return self.index == self.size - 1


class StageInput(nn.Module):
    """The embedding of a stage after the first: its output is the previous stage's activations. `links`: set
    by training/pipeline.py's `split_stage` once the pipeline group exists."""

    def __init__(self, cut: StageCut) -> None:
        super().__init__()
        self.cut = cut
        self.links: StageLinks | None = None

    def forward(self, input_ids: Tensor) -> Tensor:
        assert self.links is not None, "a stage runs after split_stage linked it to the pipeline group"
        return self.links.receive(input_ids.shape)


class StageOutput(nn.Module):
    """The final norm of a stage before the last: passes its activations on, unchanged (`links` as
    StageInput's)."""

    def __init__(self, cut: StageCut) -> None:
        super().__init__()
        self.cut = cut
        self.links: StageLinks | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        assert self.links is not None, "a stage runs after split_stage linked it to the pipeline group"
        self.links.emit(hidden)
        return hidden


@dataclass(frozen=True)
class StageParts:
    """Where a model that is cut into stages keeps its decoder (`embed_tokens`, `layers`, `norm`) and its output
    head, by attribute name: a Hugging Face causal LM's `model` and `lm_head`; a model of another shape says
    its own as a class attribute `stage_parts` (the critic's value model, models/value.py)."""

    decoder: str = "model"
    head: str = "lm_head"


def stage_parts(model: nn.Module) -> StageParts:
    """`model`'s parts (`StageParts`): its own `stage_parts`, else a causal LM's."""
    return getattr(model, "stage_parts", StageParts())


def _placeholders(model: nn.Module) -> list[StageInput | StageOutput]:
    if not isinstance(model, nn.Module):  # a plain function standing in for a model runs whole
        return []
    return [module for module in model.modules() if isinstance(module, StageInput | StageOutput)]


def pipeline_links(model: nn.Module) -> StageLinks | None:
    """The stage `model` is, or None: it runs whole (so does a plain function standing in for a model)."""
    return next((module.links for module in _placeholders(model)), None)


def stage_cut(model: nn.Module) -> StageCut | None:
    """The cut `model` went through (`cut_stage`), or None: it is whole. Every stage of two or more holds a
    placeholder (the first a StageOutput, the last a StageInput), which keeps the record."""
    return next((module.cut for module in _placeholders(model)), None)


def stage_layers(num_layers: int, stages: int) -> list[range]:
    """The layers of each stage: num_layers // stages each, one more on each of the first num_layers % stages."""
    if not 1 <= stages <= num_layers:
        raise ValueError(
            f"training.pipeline_parallel_size {stages} must be between 1 and the model's {num_layers} layers"
        )
    bounds = [0]
    for count in stage_layer_counts(num_layers, stages):
        bounds.append(bounds[-1] + count)
    return [range(start, stop) for start, stop in zip(bounds, bounds[1:])]


class StageNames:
    """A stage's parameter names and the whole model's: `{decoder}.layers.{i}` here is layer first + i there
    (`decoder`: the model's decoder attribute, models/pipeline_stage.py's `StageParts`)."""

    def __init__(self, layers: range, *, decoder: str = "model") -> None:
        self.layers, self.decoder = layers, decoder
        self._prefix = f"{decoder}.layers."

    def whole(self, name: str) -> str:
        if not name.startswith(self._prefix):
            return name
        index, rest = name[len(self._prefix) :].split(".", 1)
        return f"{self._prefix}{self.layers.start + int(index)}.{rest}"

    def local(self, name: str) -> str | None:
        """The stage's name for the whole model's `name`, or None where another stage holds it."""
        if not name.startswith(self._prefix):
            return name
        index, rest = name[len(self._prefix) :].split(".", 1)
        return f"{self._prefix}{int(index) - self.layers.start}.{rest}" if int(index) in self.layers else None


def cut_stage(model: nn.Module, *, index: int, size: int) -> StageCut:
    """Cut `model` (a decoder with `StageParts`, on any device, the meta device included) to stage `index` of
    `size`, in place, with no collective: its run of layers (`stage_layers`) kept, the embedding replaced by a
    `StageInput` after the first stage, the final norm by a `StageOutput` and the head by nothing before the
    last; a tied model's last stage gets a copy of the embedding as its head (frozen stays frozen:
    training.freeze_embeddings). A model already cut to this stage (the stage loader's, models/loading.py)
    keeps its record and loses only what it still holds of the others' (the critic's value head, added after
    the cut of its body)."""
    parts = stage_parts(model)
    decoder: Any = getattr(model, parts.decoder, None)
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList) or not hasattr(model, parts.head):
        raise ValueError(
            f"training.pipeline_parallel_size: {type(model).__name__} is not a decoder with {parts.decoder}.layers "
            f"and a head {parts.head} (Llama, Qwen2, Qwen3); use 1"
        )
    if len(set(getattr(decoder.config, "layer_types", None) or ["full_attention"])) > 1:
        raise ValueError(
            "training.pipeline_parallel_size: the model mixes attention kinds by layer (layer_types), which a "
            "stage's forward would index by its own layer numbers; use 1"
        )
    cut = stage_cut(model)
    if cut is None:
        layers = stage_layers(len(decoder.layers), size)[index]
        head: Any = getattr(model, parts.head)
        cut = StageCut(
            index=index,
            size=size,
            layers=layers,
            # routing replay's grid numbers the whole model's routers (a dense layer has none)
            first_router=sum(len(routers(decoder.layers[i])) for i in range(layers.start)),
            num_routers=len(routers(model)),
            tied=getattr(head, "weight", None) is decoder.embed_tokens.weight,
        )
        if cut.tied and cut.last:
            embedding = decoder.embed_tokens.weight
            head.weight = nn.Parameter(embedding.detach().clone(), requires_grad=embedding.requires_grad)
        decoder.layers = nn.ModuleList(decoder.layers[i] for i in layers)
    else:
        assert (cut.index, cut.size) == (index, size), f"cut to stage {cut.index} of {cut.size}, not {index} of {size}"
    if index > 0 and not isinstance(decoder.embed_tokens, StageInput):
        decoder.embed_tokens = StageInput(cut)
    if not cut.last:
        if not isinstance(decoder.norm, StageOutput):
            decoder.norm = StageOutput(cut)
        # asked for no logits or values (engines/policy.py, engines/values.py); the next stage scores
        setattr(model, parts.head, nn.Identity())
    return cut
