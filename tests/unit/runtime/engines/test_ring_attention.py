"""Ring attention (engines/ring_attention.py): its parts against one softmax over all keys, and the
ring itself on real gloo ranks (torch.multiprocessing, CPU) against one process's attention, forward
and gradients, with the three masks a pass gives it (none: causal; boolean; additive), grouped-query
heads, a CP size that divides neither head count (3 ranks, 4 heads, 2 KV heads), which Ulysses
cannot run, and a rank's block computed in tiles smaller than it (uneven and single positions).

Float64 throughout, so the comparison measures the method: the ring computes the same sums as one
softmax, cut into blocks and merged by log-sum-exp, so it differs by reassociation only, a few ulps of
float64 times the sums' length; 1e-10 relative holds on any CPU and thread count, while a block
merged with the wrong weight, a mask block off by one rank or a gradient sent the wrong way round
the ring is off by 1e-2 and up.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist
from torch import nn

from rldock.runtime.engines.ring_attention import block_output, block_scores, merge, ring_attention
from rldock.runtime.engines.ulysses import four_d_mask
from rldock.runtime.models.context_group import GROUP_ATTRIBUTE

TOLERANCE = dict(rtol=1e-10, atol=1e-12)
B, HEADS, KV_HEADS, DIM = 2, 4, 2, 8


def attention(query, key, value, mask) -> torch.Tensor:
    """One softmax over all N keys: (B, H, N, D) queries, (B, KV, N, D) keys and values, a boolean or
    additive (B, 1, N, N) mask or None (causal). Returns (B, N, H, D), as Hugging Face's functions."""
    repeats = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    length = query.shape[2]
    if mask is None:
        mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2)


def inputs(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(B, HEADS, length, DIM, generator=generator, dtype=torch.float64),
        torch.randn(B, KV_HEADS, length, DIM, generator=generator, dtype=torch.float64),
        torch.randn(B, KV_HEADS, length, DIM, generator=generator, dtype=torch.float64),
    )


def masks(length: int) -> dict[str, torch.Tensor | None]:
    """A left-padded row and a full one, as boolean and additive 4D masks, and none (causal)."""
    rows = torch.ones(B, length, dtype=torch.int64)
    rows[0, :2] = 0
    return {
        "causal": None,
        "boolean": four_d_mask(rows, kind="boolean", dtype=torch.float64),
        "additive": four_d_mask(rows, kind="additive", dtype=torch.float64),
    }


@pytest.mark.parametrize("cut", [1, 3, 5])
def test_two_blocks_merged_are_the_softmax_over_all_keys(cut):
    query, key, value = inputs(6, seed=0)
    mask = masks(6)["boolean"]
    rows = slice(0, 6)
    halves = []
    for columns in (slice(0, cut), slice(cut, 6)):
        scores = block_scores(query, key[:, :, columns], mask, rows=rows, columns=columns, scaling=DIM**-0.5)
        halves.append((block_output(torch.softmax(scores, -1), value[:, :, columns]), torch.logsumexp(scores, -1)))
    merged, _ = merge(*halves[0], *halves[1])
    expected = attention(query, key, value, mask).transpose(1, 2)
    torch.testing.assert_close(merged, expected, **TOLERANCE)


def test_a_block_a_query_cannot_see_weighs_exactly_nothing():
    query, key, value = inputs(4, seed=1)
    early = query[:, :, :2]  # positions 0 and 1: causally they see keys 0-1, none of keys 2-3
    seen = block_scores(early, key[:, :, :2], None, rows=slice(0, 2), columns=slice(0, 2), scaling=1.0)
    hidden = block_scores(early, key[:, :, 2:], None, rows=slice(0, 2), columns=slice(2, 4), scaling=1.0)
    assert torch.isfinite(hidden).all()  # the lowest value, not -inf: no NaN from a fully hidden block
    output, lse = block_output(torch.softmax(seen, -1), value[:, :, :2]), torch.logsumexp(seen, -1)
    hidden_output, hidden_lse = block_output(torch.softmax(hidden, -1), value[:, :, 2:]), torch.logsumexp(hidden, -1)
    merged, merged_lse = merge(output, lse, hidden_output, hidden_lse)
    assert torch.equal(merged, output) and torch.equal(merged_lse, lse)


def _rank(rank: int, world: int, rendezvous: str, out_dir: str, length: int, tile: int | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    module = nn.Module()
    setattr(module, GROUP_ATTRIBUTE, dist.group.WORLD)
    n = length // world
    local = slice(rank * n, (rank + 1) * n)
    results = {}
    for name, mask in masks(length).items():
        query, key, value = (t[:, :, local].clone().requires_grad_() for t in inputs(length, seed=2))
        tiles = {} if tile is None else {"tile": tile}
        output, _ = ring_attention(module, query, key, value, mask, **tiles)  # (B, n, H, D)
        weights = torch.randn(output.shape, generator=torch.Generator().manual_seed(3 + rank), dtype=output.dtype)
        (output * weights).sum().backward()
        results[name] = dict(output=output.detach(), grads=[t.grad for t in (query, key, value)], weights=weights)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("world", "tile"),
    [(2, None), (3, None), (2, 3), (3, 1)],
    ids=["cp2", "cp3-heads-not-divided", "cp2-tiles-of-3", "cp3-tiles-of-1"],
)
def test_the_ring_on_gloo_ranks_equals_one_softmax_forward_and_backward(tmp_path, world, tile):
    # n = 4 positions per rank: one tile at the default (512); tiles of 3 cut a block unevenly (4 tiles, the
    # causal pass skipping its own block's upper one), tiles of 1 into 16, every tile merged by its log-sum-exp.
    length = 4 * world
    args = (world, str(tmp_path / "rendezvous"), str(tmp_path), length, tile)
    rank_processes.spawn(_rank, args=args, nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name, mask in masks(length).items():
        query, key, value = (t.clone().requires_grad_() for t in inputs(length, seed=2))
        expected = attention(query, key, value, mask)  # (B, N, H, D)
        weights = torch.cat([got[name]["weights"] for got in ranks], dim=1)
        (expected * weights).sum().backward()
        torch.testing.assert_close(torch.cat([got[name]["output"] for got in ranks], dim=1), expected, **TOLERANCE)
        for i, tensor in enumerate((query, key, value)):  # each rank holds its positions' gradients
            got = torch.cat([r[name]["grads"][i] for r in ranks], dim=2)
            torch.testing.assert_close(got, tensor.grad, **TOLERANCE, msg=f"{name} gradient {i}")
