"""A pipeline stage as the model's own modules know it (training.pipeline_parallel_size; training/pipeline.py
splits the model): on a stage after the first, the embedding is a `StageInput` that hands the forward the
previous stage's activations; on a stage before the last, the final norm is a `StageOutput` that passes the
stage's activations on, and the LM head is gone. The passes (engines/policy.py) find the stage here, as they
find the CP group in context_group.py: below the engines, so that models/ never imports engines/.

Two ways activations move, one per kind of pass:
- streaming (a pass without gradients: old logprobs, the reference): a forward receives its input when it
  needs it (a blocking receive from the previous stage) and sends its output as soon as it has it (a
  blocking send: data flows one way, so nothing waits in a circle), and stage s computes pass i while
  stage s + 1 computes pass i - 1;
- scheduled (the update): the forward still receives its input, but its output is kept for the schedule
  (training/pipeline.py, 1F1B), which sends it together with the receive of a gradient, as one batch of
  point-to-point operations (Megatron's send_forward_recv_backward: posted one at a time, a send to the
  next stage and that stage's send back would each wait for the other's receive on HCCL and NCCL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn


@dataclass
class StageLinks:
    """Stage `index` of `size`: its pipeline group (this rank's peers in the other stages), the global ranks
    of the stages before and after it (None at the ends), and the activations' width and dtype. An MoE's
    routers are numbered over the whole model (routing replay's grid has a column per router): the stage's
    first is router `first_router` of `num_routers`. `inputs` and `outputs` keep a scheduled pass's
    activations (in forward order) for its backward."""

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
    scheduled: bool = False
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        """The last stage scores: it holds the final norm and the LM head."""
        return self.index == self.size - 1

    def receive(self, tokens: torch.Size) -> Tensor:
        """The previous stage's activations (*tokens, H) for this forward; a leaf that records its gradient
        when the forward does."""
        assert self.previous is not None
        hidden = torch.empty((*tokens, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(hidden, src=self.previous, group=self.group)
        hidden.requires_grad_(torch.is_grad_enabled())
        if self.scheduled:
            self.inputs.append(hidden)
        return hidden

    def emit(self, hidden: Tensor) -> None:
        """This stage's activations: kept for the schedule, or sent on at once (module docstring)."""
        if self.scheduled:
            self.outputs.append(hidden)
            return
        assert self.next is not None
        dist.send(hidden.detach().contiguous(), dst=self.next, group=self.group)


class StageInput(nn.Module):
    """The embedding of a stage after the first: its output is the previous stage's activations."""

    def __init__(self, links: StageLinks) -> None:
        super().__init__()
        self.links = links

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.links.receive(input_ids.shape)


class StageOutput(nn.Module):
    """The final norm of a stage before the last: passes its activations on, unchanged."""

    def __init__(self, links: StageLinks) -> None:
        super().__init__()
        self.links = links

    def forward(self, hidden: Tensor) -> Tensor:
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


def pipeline_links(model: nn.Module) -> StageLinks | None:
    """The stage `model` is, or None: it runs whole (so does a plain function standing in for a model)."""
    if not isinstance(model, nn.Module):
        return None
    for module in model.modules():
        if isinstance(module, StageInput | StageOutput):
            return module.links
    return None
