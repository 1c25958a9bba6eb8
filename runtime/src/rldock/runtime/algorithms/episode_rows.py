"""Episodes of several dock rows: a harness's episode is one row per segment (docs/agentic.md#segments), and
what counts episodes (group baselines, DAPO's filter, the reward and its metrics, the sequence means of the
loss) must count each once, not once per row.

`episode` (B,) int64 names each row's episode; an episode's rows are consecutive (the dock's layout: S
rows per episode, whole groups per batch), and its first row, the head, holds its reward (the segment
whose final turn the reward judges). A batch without segments has one row per episode (`one_per_row`),
and every function here is then the identity, bit for bit.
"""

from __future__ import annotations

import torch


def one_per_row(num_rows: int) -> torch.Tensor:
    """The episode column of a batch without segments: each row its own episode. (B,)"""
    return torch.arange(num_rows, dtype=torch.int64)


def episode_heads(episode: torch.Tensor) -> torch.Tensor:
    """(B,) bool: True on each episode's first row (its head)."""
    if episode.dim() != 1:
        raise ValueError(f"episode must have shape (B,), got {tuple(episode.shape)}")
    heads = torch.ones_like(episode, dtype=torch.bool)
    heads[1:] = episode[1:] != episode[:-1]
    return heads


def row_episodes(episode: torch.Tensor) -> torch.Tensor:
    """(B,) int64: each row's episode as an index 0..E-1 into the batch's episodes (heads in order)."""
    return torch.cumsum(episode_heads(episode).to(torch.int64), dim=0) - 1


def at_heads(values: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """Each episode's value, its head's: (B, ...) -> (E, ...)."""
    return values[episode_heads(episode)]


def to_rows(per_episode: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """Each episode's value on every one of its rows: (E, ...) -> (B, ...)."""
    return per_episode[row_episodes(episode)]


def episode_sums(values: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """Each episode's sum of its rows' `values` (B,) -> (E,)."""
    index = row_episodes(episode)
    num_episodes = int(index[-1]) + 1 if index.numel() else 0
    return torch.zeros(num_episodes, dtype=values.dtype).index_add_(0, index, values)


def episode_share(mask: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """Each row's share of its episode's valid tokens (B,) float32: `mask` (B, T) 1 on the tokens that train.
    An episode's shares sum to 1 (0 for an episode without a valid token); an empty row's is 0; a row that is
    its episode's only non-empty row has exactly 1. The sequence means of the loss count an episode once
    through them (algorithms/aggregation.py)."""
    tokens = mask.sum(dim=1).to(torch.float32)  # (B,)
    total = to_rows(episode_sums(tokens, episode), episode)  # (B,)
    return torch.where(total > 0, tokens / total.clamp(min=1.0), torch.zeros_like(tokens))
