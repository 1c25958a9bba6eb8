"""Ring attention (`training.context_parallel_mode: ring`): context parallelism whose attention passes
the keys and values around the CP group instead of exchanging heads.

Each CP rank holds its slice of every sequence, as under Ulysses (engines/ulysses.py's
`shard_forward` cuts it, the same 4D mask or none), and keeps its own queries: positions
[r n, (r + 1) n) of the N, all heads. Its keys and values travel the ring: at step s the rank holds
the block of rank (r - s) mod cp, computes its queries' scores against it (the mask's block of those
rows and columns), and passes the block on to rank r + 1 while receiving the next from rank r - 1.
The blocks' partial results are merged exactly by their log-sum-exp (the online softmax of
FlashAttention; ring attention, arXiv 2310.01889): after cp steps every query has attended every
position, each rank having sent and received cp - 1 blocks of n positions' keys and values.

Against Ulysses: no head count limit (Ulysses gives each rank H/cp heads, so cp must divide the heads
and the KV heads; ring keeps every head), and the traffic per layer is the KV blocks only,
2 (cp - 1) n n_kv d elements sent per rank, against Ulysses' (cp - 1)/cp of n (2 n_q + 2 n_kv) d;
a rank's scores exist one (t, t) tile per head at a time (below), where Ulysses' kernel sees (N, N) per
head of its H/cp.

Gradients: the ring runs again backwards in the same direction (FlashAttention's backward, per
block): each rank recomputes its queries' scores against every block from the saved log-sum-exps,
adds its queries' gradient, and the block's key and value gradients travel with the block, each rank
adding its share; one more step brings every block's gradients home. So a rank keeps only its own
queries, keys, values, output and log-sum-exps for the backward.

Tiles: a step computes its block `tile` query rows by `tile` key columns at a time (FlashAttention's
tiling; the tile is the planner's RING_TILE_POSITIONS, 512), a row tile's column tiles merged by their
log-sum-exps as the blocks are, so a score tile of (t, t) per head exists only while it is computed:
one float32 tile per head in the forward, two in the backward (the probabilities and their gradient,
each made in place of the tensor it comes from; docs/scaling.md, section 9), whatever the sequence's
length, where one (n, n) block per head grew with its square. A causal pass (no mask) skips the blocks
after the rank's own, which no query of it sees (they still travel: the next rank needs them), and in
its own block the tiles above the diagonal. The sums run in float32 for a lower-precision model, as
SDPA's kernels accumulate.

What this version does not do: overlap a step's transfer with its compute (each block is received
before its scores are computed; on gloo and the CPU there is nothing to overlap with), or balance a
causal pass's work over the ranks (the last rank computes cp blocks, the first one: the zigzag
split that evens it out is not built).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from rldock.runtime.engines.ulysses import whole_sequence_causal
from rldock.runtime.models.context_group import GROUP_ATTRIBUTE
from rldock.runtime.planning.context_parallel_bytes import RING_TILE_POSITIONS

# The attention implementation a model ran without CP -> the one ring CP gives it.
RING_IMPLEMENTATIONS = {"sdpa": "ring_sdpa", "eager": "ring_eager"}


def _shift(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """`x` sent to the next rank of the ring, the previous rank's received."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    received = torch.empty_like(x)
    operations = [
        dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, (rank + 1) % cp), group),
        dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - 1) % cp), group),
    ]
    for request in dist.batch_isend_irecv(operations):
        request.wait()
    return received


def _grouped(x: Tensor, kv_heads: int) -> Tensor:
    """(B, H, n, ...) -> (B, KV, H/KV, n, ...): the query heads that share each KV head side by side,
    so a KV head's block broadcasts over them (grouped-query attention without repeating it)."""
    return x.view(x.shape[0], kv_heads, x.shape[1] // kv_heads, *x.shape[2:])


def block_scores(
    query: Tensor,
    key: Tensor,
    attention_mask: Tensor | None,
    *,
    rows: slice,
    columns: slice,
    scaling: float,
) -> Tensor:
    """Scores (B, H, n, m) of queries (B, H, n, D) at positions `rows` against keys (B, KV, m, D) at
    positions `columns`, in float32 or wider, the mask's block applied: a boolean 4D mask (B, 1, N, N)
    False -> the dtype's lowest, an additive one added; no mask: causal by position. The lowest
    rather than -inf, so a row that sees nothing in a block gives no NaN: its log-sum-exp is the
    lowest too, and `merge` weighs it 0 against any block the row sees (its own position's)."""
    dtype = torch.promote_types(query.dtype, torch.float32)
    kv_heads = key.shape[1]
    scores = torch.matmul(_grouped(query.to(dtype), kv_heads), key.to(dtype)[:, :, None].transpose(-1, -2))
    # In place on the product: one (B, H, n, m) block at a time, where out of place each step held two.
    scores = scores.mul_(scaling).flatten(1, 2)  # (B, H, n, m)
    lowest = torch.finfo(dtype).min
    if attention_mask is None and columns.stop <= rows.start + 1:
        return scores  # causal, and every key at or before every query: nothing to hide
    if attention_mask is None:
        query_at = torch.arange(rows.start, rows.stop, device=query.device)
        key_at = torch.arange(columns.start, columns.stop, device=query.device)
        return scores.masked_fill_(key_at[None, :] > query_at[:, None], lowest)
    block = attention_mask[..., rows, columns]
    if block.dtype == torch.bool:
        return scores.masked_fill_(~block, lowest)
    # An additive mask's "does not attend" is its dtype's lowest; lower still in float32 is no better.
    return scores.add_(block.to(dtype)).clamp_(min=lowest)


def block_output(probabilities: Tensor, value: Tensor) -> Tensor:
    """(B, H, n, m) attention weights over a block's values (B, KV, m, D) -> (B, H, n, D)."""
    kv_heads = value.shape[1]
    grouped = torch.matmul(_grouped(probabilities, kv_heads), value.to(probabilities.dtype)[:, :, None])
    return grouped.flatten(1, 2)


def merge(output: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Two partial softmax attentions over disjoint key sets, (B, H, n, D) outputs each normalised over
    its own keys with log-sum-exps (B, H, n): the attention over both keys, exactly."""
    total = torch.logaddexp(lse, block_lse)
    merged = output * torch.exp(lse - total)[..., None] + block_out * torch.exp(block_lse - total)[..., None]
    return merged, total


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward (module docstring). Saved for the backward: this rank's queries,
    keys, values, output and log-sum-exps, O(n) per rank; each tile's scores exist only while it is
    computed, in the forward and again in the backward (FlashAttention's recomputation)."""

    @staticmethod
    def forward(
        ctx: Any,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        group: dist.ProcessGroup,
        scaling: float,
        tile: int,
    ) -> Tensor:
        ring = _Ring(group, n=query.shape[2], causal=attention_mask is None, tile=tile)
        output = lse = None
        block = torch.stack([key, value])  # (2, B, KV, n, D): one transfer per step
        for step in range(ring.cp):
            if step:
                block = _shift(block, group)
            columns = ring.columns(step)
            if columns is None:
                continue
            out, out_lse = _block_forward(query, block, attention_mask, ring, columns=columns, scaling=scaling)
            output, lse = (out, out_lse) if output is None or lse is None else merge(output, lse, out, out_lse)
        assert output is not None and lse is not None  # a rank's own block is never skipped
        ctx.ring, ctx.scaling = ring, scaling
        ctx.save_for_backward(query, key, value, output, lse, attention_mask)
        return output.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, output, lse, attention_mask = ctx.saved_tensors
        ring, scaling = ctx.ring, ctx.scaling
        grad = grad_output.to(output.dtype)
        # The softmax's backward through the merge: dS = P (dP - rowsum(dO * O)), P = exp(S - lse).
        correction = (grad * output).sum(dim=-1, keepdim=True)  # (B, H, n, 1)
        grad_query = torch.zeros_like(output)
        block = torch.stack([key, value])
        grad_block = torch.zeros(block.shape, dtype=output.dtype, device=block.device)  # travels with its block
        for step in range(ring.cp):
            if step:
                block, grad_block = _shift(block, ring.group), _shift(grad_block, ring.group)
            columns = ring.columns(step)
            if columns is None:
                continue
            _block_backward(
                query,
                block,
                attention_mask,
                grad,
                lse,
                correction,
                ring,
                columns=columns,
                scaling=scaling,
                grad_query=grad_query,
                grad_block=grad_block,
            )
        # After the last step a rank holds the block of rank r + 1 and its gradients from every rank:
        # one more step brings each block's gradients home.
        grad_block = _shift(grad_block, ring.group)
        return (
            grad_query.to(query.dtype),
            grad_block[0].to(key.dtype),
            grad_block[1].to(value.dtype),
            None,
            None,
            None,
            None,
        )


def _block_forward(
    query: Tensor, block: Tensor, attention_mask: Tensor | None, ring: _Ring, *, columns: slice, scaling: float
) -> tuple[Tensor, Tensor]:
    """One step of the forward: the queries' attention over the held key-and-value block (2, B, KV, m, D) at
    positions `columns`, its output (B, H, n, D) and log-sum-exps (B, H, n), a tile of rows by a tile of
    columns at a time, each row tile's tiles merged as the ring merges its blocks."""
    outputs, lses = [], []
    for rows, row_tiles in ring.row_tiles():
        output = lse = None
        for column_tiles in ring.column_tiles(rows, columns):
            out, out_lse = _tile_forward(
                query[:, :, row_tiles],
                block[:, :, :, ring.local(column_tiles, columns)],
                attention_mask,
                rows=rows,
                columns=column_tiles,
                scaling=scaling,
            )
            output, lse = (out, out_lse) if output is None or lse is None else merge(output, lse, out, out_lse)
        assert output is not None and lse is not None  # a row tile sees its own tile at least
        outputs.append(output)
        lses.append(lse)
    return torch.cat(outputs, dim=2), torch.cat(lses, dim=2)


def _tile_forward(
    query: Tensor, block: Tensor, attention_mask: Tensor | None, *, rows: slice, columns: slice, scaling: float
) -> tuple[Tensor, Tensor]:
    """One tile of the forward: queries (B, H, t, D) at positions `rows` over keys and values (2, B, KV, u, D) at
    `columns`, the output (B, H, t, D) and log-sum-exps (B, H, t). The softmax is exp(S - lse), taken in the
    scores' storage, so the tile holds one (B, H, t, u) score tile; its temporaries go when it returns."""
    scores = block_scores(query, block[0], attention_mask, rows=rows, columns=columns, scaling=scaling)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = scores.sub_(lse[..., None]).exp_()  # (B, H, t, u), in place of the scores
    return block_output(probabilities, block[1]), lse


def _block_backward(
    query: Tensor,
    block: Tensor,
    attention_mask: Tensor | None,
    grad: Tensor,
    lse: Tensor,
    correction: Tensor,
    ring: _Ring,
    *,
    columns: slice,
    scaling: float,
    grad_query: Tensor,
    grad_block: Tensor,
) -> None:
    """One step of the backward against the held block (2, B, KV, m, D) at positions `columns`, tile by tile:
    adds this rank's queries' gradient share to `grad_query` (B, H, n, D) and the block's key and value
    gradients to `grad_block` (2, B, KV, m, D), both in the dtype of `grad` (float32 or wider)."""
    for rows, row_tiles in ring.row_tiles():
        for column_tiles in ring.column_tiles(rows, columns):
            in_block = ring.local(column_tiles, columns)
            part_query, part_block = _tile_backward(
                query[:, :, row_tiles],
                block[:, :, :, in_block],
                attention_mask,
                grad[:, :, row_tiles],
                lse[:, :, row_tiles],
                correction[:, :, row_tiles],
                rows=rows,
                columns=column_tiles,
                scaling=scaling,
            )
            grad_query[:, :, row_tiles] += part_query
            grad_block[:, :, :, in_block] += part_block


def _tile_backward(
    query: Tensor,
    block: Tensor,
    attention_mask: Tensor | None,
    grad: Tensor,
    lse: Tensor,
    correction: Tensor,
    *,
    rows: slice,
    columns: slice,
    scaling: float,
) -> tuple[Tensor, Tensor]:
    """One tile of the backward: queries (B, H, t, D) at positions `rows` against keys and values
    (2, B, KV, u, D) at `columns`, the queries' gradient share (B, H, t, D) and the keys' and values' (2, B, KV,
    u, D), in the dtype of `grad`. The scores are recomputed and turned into the probabilities in place, and
    the gradient of the probabilities into the scores' in place, so the tile holds two (B, H, t, u) score tiles
    at most (out of place it held up to six: the scores, the probabilities, their gradient and the product's
    temporaries); every one goes when it returns (kept across a loop's steps, the last tile's would stay beside
    the next)."""
    dtype, kv_heads = grad.dtype, block.shape[2]
    block_key, block_value = block[0].to(dtype), block[1].to(dtype)
    scores = block_scores(query, block_key, attention_mask, rows=rows, columns=columns, scaling=scaling)
    probabilities = scores.sub_(lse[..., None]).exp_()  # (B, H, t, u): P = exp(S - lse), in place of S
    grouped_grad = _grouped(grad, kv_heads)
    grad_value = torch.matmul(_grouped(probabilities, kv_heads).transpose(-1, -2), grouped_grad).sum(dim=2)
    grad_p = torch.matmul(grouped_grad, block_value[:, :, None].transpose(-1, -2)).flatten(1, 2)  # (B, H, t, u)
    # dS = P (dP - rowsum(dO * O)) scaling, in place of dP; P is not needed after it
    grad_scores = grad_p.sub_(correction).mul_(probabilities).mul_(scaling)
    del scores, probabilities
    grad_query = block_output(grad_scores, block_key)
    grouped_query = _grouped(query.to(dtype), kv_heads)
    grad_key = torch.matmul(_grouped(grad_scores, kv_heads).transpose(-1, -2), grouped_query).sum(dim=2)
    return grad_query, torch.stack([grad_key, grad_value])  # (B, KV, u, D) each


class _Ring:
    """One rank's place in the ring: its rows (positions) and, per step, the columns of the block it
    holds then, or None where a causal pass needs none of it (every key after every query); and the tiles
    a step computes a block in (`tile` rows by `tile` columns), a causal pass skipping those whose every
    key comes after every query."""

    def __init__(self, group: dist.ProcessGroup, *, n: int, causal: bool, tile: int) -> None:
        self.group, self.n, self.causal, self.tile = group, n, causal, tile
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.rows = slice(self.rank * n, (self.rank + 1) * n)

    def columns(self, step: int) -> slice | None:
        source = (self.rank - step) % self.cp
        if self.causal and source > self.rank:
            return None
        return slice(source * self.n, (source + 1) * self.n)

    def row_tiles(self) -> list[tuple[slice, slice]]:
        """This rank's row tiles: (positions in the sequence, positions in the rank's n)."""
        return [(tile, self.local(tile, self.rows)) for tile in _cut(self.rows, self.tile)]

    def column_tiles(self, rows: slice, columns: slice) -> list[slice]:
        """The column tiles of block `columns` the row tile `rows` computes (positions in the sequence)."""
        return [tile for tile in _cut(columns, self.tile) if not (self.causal and tile.start >= rows.stop)]

    @staticmethod
    def local(tile: slice, within: slice) -> slice:
        return slice(tile.start - within.start, tile.stop - within.start)


def _cut(positions: slice, tile: int) -> list[slice]:
    """`positions` cut into runs of `tile`, the last shorter."""
    return [slice(start, min(start + tile, positions.stop)) for start in range(positions.start, positions.stop, tile)]


def ring_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tile: int = RING_TILE_POSITIONS,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Hugging Face's attention-function signature: `query` (B, H, n, D), `key`/`value` (B, KV, n, D)
    of this rank's n positions; `attention_mask` (B, 1, N, N) over all N or None (causal). Returns
    (B, n, H, D) in the query's dtype. `tile`: the score tiles' rows and columns (the planner's)."""
    if dropout:
        raise ValueError("ring attention runs the training passes, which use no attention dropout")
    group = getattr(module, GROUP_ATTRIBUTE)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    output = _RingAttention.apply(query, key, value, attention_mask, group, scale, tile)
    return output.transpose(1, 2).contiguous(), None


# A pass given no mask gets none (whole_sequence_causal): the ring applies causality by position.
for _implementation in RING_IMPLEMENTATIONS.values():
    AttentionInterface.register(_implementation, ring_attention)
    AttentionMaskInterface.register(_implementation, whole_sequence_causal)
