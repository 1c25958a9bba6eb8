"""Mixture-of-experts models: finding their routers, recording what the routers chose during a
forward pass, the router's auxiliary load-balancing loss and the expert-load metrics (the update adds
them through models/router_loss.py).

A Hugging Face MoE decoder layer (Qwen3-MoE, Mixtral, DeepSeek-V3 in transformers 5) holds a sparse block whose
`gate` is a top-k router returning `(router_logits (T, E), top_k_weights (T, k), top_k_index (T, k))`
over the T tokens of the pass, and whose `experts` apply the chosen experts. Nothing here changes
the forward: `RouterRecord` reads the routers' outputs through forward hooks (with their autograd
graph, so the auxiliary loss trains the routers) and the top-level model's attention mask through a
pre-hook, so padding is counted out of the loss and the metrics.

The loss is a product of two sums over every layer's real tokens (`balance_loss`), so what a part of
the routing contributes is kept as the sums (`RouterTotals`: per-expert token counts and probability
sums, and the rows counted), which add over the parts, and the product is taken last. Under context
parallelism (engines/ulysses.py) a CP rank's routers see its slice of the positions: the pass tells
the record which of its tokens are real (`RouterRecord.begin_pass`, the cells routing replay reads
too), and the totals are summed over the CP group, so every rank computes the whole sequence's loss
(its gradient is then the rank's own tokens' share, summed over CP with the rest,
training/context_parallel.py). Under pipeline parallelism a stage's routers are a run of the whole
model's, and the stages' totals are added along the pipeline (models/router_loss.py).

DeepSeek-V3's router returns the same three, its logits being what its sigmoid scores: the loss here takes
their softmax as it does Qwen's (DeepSeek's own sequence-wise loss on its normalised sigmoid scores is not
built); its config has no router_aux_loss_coef, so the loss is off unless training.router_aux_loss_coef sets
one, while the expert-load metrics count its choices as anyone's.

The dispatch is dropless (every token reaches its k experts; Hugging Face's and vLLM's MoE have no
expert capacity), so there is no dropped-token share to report.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rldock.runtime.models.context_group import sum_over_group

if TYPE_CHECKING:
    from rldock.runtime.models.pass_cells import PassCells

# The Hugging Face config fields of an MoE model, by model type: experts, experts per token.
MOE_CONFIG_FIELDS = {
    "qwen3_moe": ("num_experts", "num_experts_per_tok"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok"),
    "mixtral": ("num_local_experts", "num_experts_per_tok"),
    "deepseek_v3": ("n_routed_experts", "num_experts_per_tok"),
}


# transformers 5 fuses each layer's experts into (E, 2I, H) `gate_up_proj` and (E, H, I) `down_proj`;
# Hub checkpoints (and vLLM's loaders) keep one tensor per expert. Per model type, as data: the sparse
# block's name in the checkpoint, and each fused tensor's per-expert names, its slice cut into equal
# row blocks in this order (gate first, as the fused forward chunks it).
CHECKPOINT_EXPERTS: dict[str, tuple[str, dict[str, tuple[str, ...]]]] = {
    "qwen3_moe": ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
    "qwen2_moe": ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
    "mixtral": ("block_sparse_moe", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
    "deepseek_v3": ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
}


def unfuse_experts(weights: Iterable[tuple[str, Tensor]], *, model_type: str) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) pairs in the Hub checkpoint's names for `model_type`: every fused expert tensor
    split per expert (views, no copy), the sparse block renamed where the checkpoint names it
    otherwise (Mixtral's `block_sparse_moe`); other pairs, and every pair of a dense model, as they are."""
    if model_type not in CHECKPOINT_EXPERTS:
        yield from weights
        return
    block, fused = CHECKPOINT_EXPERTS[model_type]
    for name, tensor in weights:
        name = name.replace(".mlp.", f".{block}.", 1) if ".mlp.experts." in name or ".mlp.gate." in name else name
        prefix, _, leaf = name.rpartition(".")
        if leaf not in fused or not prefix.endswith(".experts") or tensor.dim() != 3:
            yield name, tensor
            continue
        parts = fused[leaf]
        for expert in range(tensor.shape[0]):
            chunks = tensor[expert].chunk(len(parts), dim=0)
            for target, chunk in zip(parts, chunks, strict=True):
                yield f"{prefix}.{expert}.{target}.weight", chunk


@dataclass(frozen=True)
class MoeShape:
    """An MoE model's routing shape, from its Hugging Face config."""

    num_experts: int
    top_k: int
    num_layers: int  # MoE layers (DeepSeek's first `first_k_dense_replace` layers are dense)
    router_aux_loss_coef: float  # the config's coefficient (0 where it has none)


def moe_shape(config) -> MoeShape | None:
    """The routing shape of a Hugging Face config, None for a dense model."""
    fields = MOE_CONFIG_FIELDS.get(getattr(config, "model_type", ""))
    if fields is None:
        return None
    experts, top_k = fields
    return MoeShape(
        num_experts=int(getattr(config, experts)),
        top_k=int(getattr(config, top_k)),
        num_layers=int(config.num_hidden_layers) - int(getattr(config, "first_k_dense_replace", 0) or 0),
        router_aux_loss_coef=float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0),
    )


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order: each sparse block's `gate` (a module with
    `top_k` and `num_experts`). Empty for a dense model."""
    return [
        cast(nn.Module, module.gate)
        for module in model.modules()
        if hasattr(module, "gate") and hasattr(module, "experts") and hasattr(module.gate, "top_k")
    ]


def is_moe(model: nn.Module) -> bool:
    return bool(routers(model))


@dataclass
class RouterRecord:
    """What the routers of one or more forward passes chose: per pass, per MoE layer, the router
    logits (T, E) (with their graph) and the chosen experts (T, k); and the pass's token mask (T,)
    (1 on real tokens; all ones for a packed pass, which has no padding)."""

    logits: list[list[Tensor]] = field(default_factory=list)  # [pass][layer] (T, E)
    indices: list[list[Tensor]] = field(default_factory=list)  # [pass][layer] (T, k) int64
    masks: list[Tensor] = field(default_factory=list)  # [pass] (T,) float32
    announced: Tensor | None = None  # the next pass's real tokens (C,), where the pass said (`begin_pass`)

    def begin_pass(self, cells: PassCells) -> None:
        """The next pass's real tokens are `cells.tokens` (the routing-replay listener's protocol): what
        a CP pass must say, its 4D mask or none telling padding from tokens on no rank."""
        self.announced = cells.tokens

    def layer_logits(self, layer: int) -> Tensor:
        return torch.cat([one[layer] for one in self.logits])  # (T_all, E)

    def layer_indices(self, layer: int) -> Tensor:
        return torch.cat([one[layer] for one in self.indices])  # (T_all, k)

    @property
    def mask(self) -> Tensor:
        return torch.cat(self.masks)  # (T_all,)

    @property
    def num_layers(self) -> int:
        return len(self.logits[0]) if self.logits else 0


def _pass_mask(kwargs: dict) -> Tensor | None:
    """The (T,) real-token mask of a pass from the model's keyword arguments: a 2D attention mask
    flattened; None for a 4D (packed) mask or none at all (every token real)."""
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return mask.reshape(-1).float()
    return None


@contextmanager
def record_routing(model: nn.Module) -> Iterator[RouterRecord]:
    """Record every router's output while the block runs (module docstring). `model` is the Hugging
    Face model (or any module holding it); a wrapper's forward (DDP, FSDP) reaches its hooks."""
    record = RouterRecord()
    gates = routers(model)
    handles = []

    def before_pass(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = ids.numel() if ids is not None else 0
        mask = _pass_mask(kwargs)
        if record.announced is not None:
            mask = torch.zeros(tokens).index_fill(0, record.announced.cpu(), 1.0)  # host, as a packed pass's
            record.announced = None
        record.masks.append(mask if mask is not None else torch.ones(tokens))
        record.logits.append([])
        record.indices.append([])

    def after_router(_module, _args, output):
        logits, _weights, indices = output
        record.logits[-1].append(logits)
        record.indices[-1].append(indices)

    top = next(m for m in model.modules() if hasattr(m, "config") and hasattr(m, "get_decoder"))
    handles.append(top.register_forward_pre_hook(before_pass, with_kwargs=True))
    handles += [gate.register_forward_hook(after_router) for gate in gates]
    try:
        yield record
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class RouterTotals:
    """What the load-balancing loss and the expert-load metrics need of a pass's routing, as sums: each adds
    over layers, tokens, the CP ranks that hold slices of the same rows and the pipeline stages that hold
    runs of the same layers, so a rank's or a stage's part plus the others' is the whole's (the loss's
    product of two sums does not split that way, so it is taken from the totals last: `balance_loss`)."""

    counts: Tensor  # (R, E) the real tokens' top-k assignments per router (the whole model's MoE layers) and expert
    probs: Tensor  # (E,) the router's probability of each expert summed over the real tokens and the layers; with graph
    rows: Tensor  # () the (layer, real token) pairs counted: Hugging Face's rows, every layer's tokens concatenated

    def __add__(self, other: RouterTotals) -> RouterTotals:
        return RouterTotals(self.counts + other.counts, self.probs + other.probs, self.rows + other.rows)

    def flat(self) -> Tensor:
        """One vector (R E + E + 1,): what a pipeline stage passes on with its activations."""
        return torch.cat([self.counts.reshape(-1), self.probs, self.rows.reshape(1)])

    @staticmethod
    def from_flat(flat: Tensor, *, num_routers: int, num_experts: int) -> RouterTotals:
        """Inverse of `flat` (views of `flat`: its gradient reaches the probabilities' slice)."""
        size = num_routers * num_experts
        counts = flat[:size].reshape(num_routers, num_experts)
        return RouterTotals(counts, flat[size : size + num_experts], flat[size + num_experts])

    def summed_over(self, group: dist.ProcessGroup | None) -> RouterTotals:
        """Summed over the CP `group` (None: as they are): the counts carry no gradient; the probabilities'
        sum gives each rank its own tokens' gradient (models/context_group.py)."""
        if group is None:
            return self
        counts = torch.cat([self.counts.detach().reshape(-1), self.rows.detach().reshape(1)])
        dist.all_reduce(counts, group=group)
        return RouterTotals(counts[:-1].reshape(self.counts.shape), sum_over_group(self.probs, group), counts[-1])


def totals_width(*, num_routers: int, num_experts: int) -> int:
    """The length of `RouterTotals.flat()` for a model of `num_routers` routers over `num_experts` experts."""
    return num_routers * num_experts + num_experts + 1


def router_totals(
    record: RouterRecord, *, num_experts: int, top_k: int, first_router: int = 0, num_routers: int | None = None
) -> RouterTotals:
    """The `RouterTotals` of the recorded real tokens: the record's layers are routers first_router,
    first_router + 1, ... of the whole model's `num_routers` (a pipeline stage's run; default: the record's
    own, the whole model). At least float32 (a bf16 router's logits upcast), a float64 model's in float64."""
    dtype = torch.promote_types(record.logits[0][0].dtype, torch.float32)
    mask = record.mask.to(record.logits[0][0].device, dtype)  # (T,)
    layers = record.num_layers
    counts = torch.zeros(num_routers or layers, num_experts, device=mask.device, dtype=dtype)
    probs = torch.zeros(num_experts, device=mask.device, dtype=dtype)
    for layer in range(layers):
        chosen = record.layer_indices(layer).reshape(-1)  # (T k,)
        counts[first_router + layer].scatter_add_(0, chosen, mask.repeat_interleave(top_k))
        probs = probs + (torch.softmax(record.layer_logits(layer).to(dtype), dim=-1) * mask[:, None]).sum(dim=0)
    return RouterTotals(counts, probs, mask.sum() * layers)


def balance_loss(totals: RouterTotals) -> Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6) as Hugging Face computes it for
    Qwen3-MoE and Mixtral (`load_balancing_loss_func`, every layer's real tokens concatenated into one set
    of rows): E * sum_e f_e * P_e, with f_e expert e's assignments per row and P_e its mean router
    probability over the rows. f sums to k over the experts (each token counts k assignments), so the loss
    is k when routing is uniform and E when every token goes to the same k experts with certainty.
    Differentiable through the probabilities (the counts are the top-k's choice)."""
    num_experts = totals.probs.shape[0]
    rows = totals.rows.detach().clamp(min=1)
    tokens_per_expert = totals.counts.detach().sum(dim=0)  # (E,)
    return num_experts * torch.sum((tokens_per_expert / rows) * (totals.probs / rows))


def load_balancing_loss(
    record: RouterRecord, *, num_experts: int, top_k: int, group: dist.ProcessGroup | None = None
) -> Tensor:
    """`balance_loss` over the recorded real tokens of every layer, differentiable through the router
    logits. `group`: the CP group whose ranks recorded slices of the same sequences (module docstring),
    None for whole sequences."""
    totals = router_totals(record, num_experts=num_experts, top_k=top_k)
    return balance_loss(totals.summed_over(group))


def expert_load(totals: RouterTotals) -> Tensor:
    """Each layer's share of the real tokens' top-k assignments per expert, (layers, E) on the host, rows
    summing to 1 (a layer no token reached: zeros)."""
    counts = totals.counts.detach().cpu()
    return counts / counts.sum(dim=1, keepdim=True).clamp(min=1)


def expert_load_metrics(load: Tensor) -> dict[str, float]:
    """`moe/expert_load_max`: the busiest expert's share over the balanced share (1 = balanced, E = every
    token to one expert), the worst layer's; `moe/expert_load_min` likewise for the idlest (0 = an
    expert no token reached); per layer `moe/layer{i}/expert_load_max`. `load` is (layers, E)."""
    num_experts = load.shape[1]
    relative = load * num_experts  # (layers, E), 1 where balanced
    metrics = {
        "moe/expert_load_max": float(relative.max()),
        "moe/expert_load_min": float(relative.min()),
    }
    for layer, row in enumerate(relative):
        metrics[f"moe/layer{layer}/expert_load_max"] = float(row.max())
    return metrics
