"""Ulysses context parallelism (`training.context_parallel_size`, `context_parallel_mode: ulysses`): a
pass's sequence split over a group of CP ranks, attention computed over the whole sequence by
all-to-all over heads. The sequence's split (`shard_forward`) and the masks here serve both modes.

Each CP rank of a group holds the same rows and computes 1/cp of their positions: the embeddings,
the projections, the MLPs and the norms run on its slice of the sequence (positions [r n, (r + 1) n)
of the N, padded up to a multiple of cp). Attention needs every position, so before it an
all-to-all turns the (B, H, n, D) sequence shards of the queries, keys and values into (B, H/cp, N, D)
head shards (rank r gets heads [r H/cp, (r + 1) H/cp) and KV heads [r KV/cp, ...), so each query
head keeps its own KV head under grouped-query attention), the rank runs the model's attention
kernel on its heads over the whole sequence and the whole 4D mask, and a second all-to-all turns the
(B, N, H/cp, D) output back into (B, n, H, D) (DeepSpeed-Ulysses, arXiv 2309.14509; verl and
MindSpeed's `ulysses`). Activations per rank fall by cp, attention's scores by cp (heads), and each
layer moves 4 tensors of B N H D / cp elements per rank each way (queries, keys and values in, the
output back; fewer with grouped-query KV: `planning/memory.py` counts them).

The model is Hugging Face's: `apply_context_attention` (engines/context_attention.py, which also
gives the other CP mode, ring attention) points the model's config at the attention function
registered here (`ulysses_sdpa` for a model that ran `sdpa`, `ulysses_eager` for `eager`; the
kernel is SDPA for both, with the boolean or additive 4D mask of the original), so rotary
embeddings, grouped-query attention and activation checkpointing's recomputation run as they do
without CP. The passes (engines/policy.py, engines/values.py) then always give the model a 4D mask
over the whole (padded) sequence and their rank's slice of token ids and positions; positions are
the row's or the packed pass's, so packing composes unchanged.

Gradients: every CP rank computes the same loss from the same summed outputs (`sum_over_group`,
models/context_group.py, whose backward is the identity for that reason), and each rank's parameter
gradients are those of its own positions, so the true gradient is their sum over the CP group: the
training backend sums over CP and averages over DP (`training/context_parallel.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from rldock.runtime.models.context_group import GROUP_ATTRIBUTE

# The attention implementation a model ran without CP -> the one apply_ulysses gives it.
ULYSSES_IMPLEMENTATIONS = {"sdpa": "ulysses_sdpa", "eager": "ulysses_eager"}


class _AllToAll(torch.autograd.Function):
    """Split `x` into cp chunks along `scatter_dim`, send chunk j to rank j, and concatenate what
    arrives (rank j's chunk for this rank) along `gather_dim`. Its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _exchange(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def _exchange(x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:
    cp = dist.get_world_size(group)
    send = torch.stack(x.chunk(cp, dim=scatter_dim)).contiguous()  # (cp, ...): chunk j goes to rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


def all_to_all(x: Tensor, *, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


def ulysses_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs: Any
) -> tuple[Tensor, None]:
    """Hugging Face's attention-function signature: `query` (B, H, n, D), `key`/`value` (B, KV, n, D)
    of this rank's n positions; `attention_mask` (B, 1, N, N) over all N. Returns (B, n, H, D)."""
    group = getattr(module, GROUP_ATTRIBUTE)
    query, key, value = (all_to_all(t, scatter_dim=1, gather_dim=2, group=group) for t in (query, key, value))
    mask = in_compute_dtype(attention_mask, query.dtype)
    output, _ = sdpa_attention_forward(module, query, key, value, mask, **kwargs)  # (B, N, H/cp, D)
    return all_to_all(output, scatter_dim=1, gather_dim=2, group=group), None


def in_compute_dtype(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """An additive mask (0 attends, below 0 does not) in the queries' dtype `dtype`, which SDPA needs:
    the passes build it before the forward, in the stored parameters' dtype, and under FSDP mixed
    precision those are float32 while the attention computes in bfloat16. A boolean mask, a mask
    already in `dtype`, or none, as is."""
    if mask is None or mask.dtype in (torch.bool, dtype):
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask < 0, torch.finfo(dtype).min)


def whole_sequence_causal(*args: Any, **kwargs: Any) -> None:
    """Hugging Face's mask-function signature, for a Ulysses pass given no mask: None, so the
    attention is causal over the whole gathered sequence (a 4D mask skips this; a 2D one never comes,
    the passes turn it into a 4D mask or none, `pass_mask`)."""
    return None


for _implementation in ULYSSES_IMPLEMENTATIONS.values():
    AttentionInterface.register(_implementation, ulysses_attention)
    AttentionMaskInterface.register(_implementation, whole_sequence_causal)


def context_mask(model: nn.Module) -> tuple[str, torch.dtype]:
    """The 4D mask a CP model's passes give it: boolean for the modes' `_sdpa` implementations,
    additive for their `_eager` ones, and the dtype an additive one is built in (the stored
    parameters'; the attention takes it to the queries' dtype, `in_compute_dtype`)."""
    module = next(m for m in model.modules() if hasattr(m, GROUP_ATTRIBUTE))
    implementation = getattr(module, "config")._attn_implementation  # noqa: B009 (an nn.Module attribute to mypy)
    kind = "boolean" if implementation.endswith("_sdpa") else "additive"
    return kind, next(module.parameters()).dtype


def pass_mask(attention_mask: Tensor, *, kind: str, dtype: torch.dtype) -> Tensor | None:
    """The mask a CP pass gives the model for its rows' (B, L) 2D mask: none where no row has a pad
    (attention is then causal over the whole sequence, and the positions `shard_forward` appends come
    after every real token, so none sees them), else `four_d_mask`. A 4D mask (a packed pass) as is."""
    if attention_mask.dim() == 4:
        return attention_mask
    if bool(attention_mask.all()):
        return None
    return four_d_mask(attention_mask, kind=kind, dtype=dtype)


def four_d_mask(attention_mask: Tensor, *, kind: str, dtype: torch.dtype) -> Tensor:
    """The (B, 1, L, L) mask of padded rows' (B, L) 2D mask: token i attends j <= i where j is real,
    as Hugging Face builds it; a pad attends itself only (its output is never read, and a row with
    no key would give NaN)."""
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()  # (L, L)
    allowed = causal[None] & attention_mask.bool()[:, None, :]  # (B, L, L)
    allowed |= torch.eye(length, dtype=torch.bool, device=attention_mask.device)[None]
    return _mask_of_kind(allowed[:, None], kind=kind, dtype=dtype)


def _mask_of_kind(allowed: Tensor, *, kind: str, dtype: torch.dtype) -> Tensor:
    if kind == "boolean":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def padded_length(length: int, cp: int) -> int:
    return -(-length // cp) * cp


def pad_mask(mask: Tensor, length: int, *, kind: str) -> Tensor:
    """A (B, 1, N, N) 4D mask grown to (B, 1, length, length): the added positions attend themselves
    only and nothing attends them."""
    extra = length - mask.shape[-1]
    if extra == 0:
        return mask
    if kind == "boolean":
        grown = nn.functional.pad(mask, (0, extra, 0, extra), value=False)
        index = torch.arange(mask.shape[-1], length, device=mask.device)
        grown[..., index, index] = True
        return grown
    low = torch.finfo(mask.dtype).min
    grown = nn.functional.pad(mask, (0, extra, 0, extra), value=low)
    index = torch.arange(mask.shape[-1], length, device=mask.device)
    grown[..., index, index] = 0
    return grown


def local_positions(length: int, group: dist.ProcessGroup) -> tuple[int, slice]:
    """A pass of `length` positions under CP over `group`: its length padded to a multiple of cp, and
    this rank's slice of the padded positions (`shard_forward` computes those)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = padded_length(length, cp)
    n = padded // cp
    return padded, slice(rank * n, (rank + 1) * n)


def shard_forward(
    forward: Callable[[Tensor, Tensor | None, Tensor], Tensor],
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor,
    *,
    group: dist.ProcessGroup,
    kind: str,
) -> tuple[Tensor, slice]:
    """Run `forward(input_ids, mask, position_ids)` on this CP rank's slice of a pass: token ids and
    positions (B, N), the 4D mask (B, 1, N, N) or None (causal, `pass_mask`). The sequence is padded
    to a multiple of cp (pad id 0, position 0, masked as `pad_mask` says). Returns the output for
    this rank's positions (B, n, ...) and their slice of the padded sequence."""
    length, local = local_positions(input_ids.shape[1], group)
    extra = length - input_ids.shape[1]
    input_ids = nn.functional.pad(input_ids, (0, extra))[:, local]  # (B, n)
    position_ids = nn.functional.pad(position_ids, (0, extra))[:, local]  # (B, n)
    mask = None if attention_mask is None else pad_mask(attention_mask, length, kind=kind)
    return forward(input_ids, mask, position_ids), local
