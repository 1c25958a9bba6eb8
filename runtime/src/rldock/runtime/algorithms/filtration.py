"""PF-PPO policy filtration (Zhang et al., "Policy Filtration in RLHF to Fine-Tune LLM for Code
Generation", arXiv 2409.06957): train the policy on the responses whose rewards are most reliable.

Each mode turns a batch's rewards into one weight per response; the policy loss of a response is
multiplied by its weight (0 filters it out). The modes, per prompt group of N responses:
- `best_of_n` (the paper's BoN): the highest-reward response only.
- `best_random` (BR): the best and one other drawn uniformly at random.
- `best_worst` (BW): the best and the worst.
- `pow`: no hard filter; every response weighted by |reward| ** power (the reweighting verl calls
  `pow`), so high-reward responses count more.
Weights are rescaled to mean 1 over the batch so the policy loss keeps PPO's scale.
Ties go to the lower index, so the result is deterministic for a given batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rldock.runtime.registry import Registry

FiltrationFn = Callable[..., torch.Tensor]  # (groups (G, N), **options) -> weights (G, N)

FILTRATION_MODES: Registry[FiltrationFn] = Registry("policy filtration mode", field="algorithm.pf_ppo.mode")
register_filtration = FILTRATION_MODES.register


def _one_hot_rows(columns: torch.Tensor, width: int) -> torch.Tensor:
    """(G,) column per row -> (G, width) float32 with a 1 at that column."""
    return torch.nn.functional.one_hot(columns, width).float()


@register_filtration("best_of_n")
def best_of_n(groups: torch.Tensor, **_: object) -> torch.Tensor:
    return _one_hot_rows(groups.argmax(dim=1), groups.shape[1])


@register_filtration("best_worst")
def best_worst(groups: torch.Tensor, **_: object) -> torch.Tensor:
    best = _one_hot_rows(groups.argmax(dim=1), groups.shape[1])
    worst = _one_hot_rows(groups.argmin(dim=1), groups.shape[1])
    # A group whose rewards are all equal has best == worst: it keeps one response, not two.
    return torch.maximum(best, worst)


@register_filtration("best_random")
def best_random(groups: torch.Tensor, *, generator: torch.Generator | None = None, **_: object) -> torch.Tensor:
    num_groups, width = groups.shape
    best = groups.argmax(dim=1)  # (G,)
    # Uniform over the N-1 other responses: draw an offset in [1, N) from the best one.
    offset = torch.randint(1, width, (num_groups,), generator=generator)  # (G,)
    other = (best + offset) % width
    return _one_hot_rows(best, width) + _one_hot_rows(other, width)


@register_filtration("pow")
def reward_power(groups: torch.Tensor, *, power: float = 2.0, **_: object) -> torch.Tensor:
    return groups.abs() ** power


def filtration_weights(
    rewards: torch.Tensor, group_size: int, mode: str, *, power: float = 2.0, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Per-response policy-loss weights (B,) from rewards (B,) in consecutive groups of `group_size`.

    Weights are >= 0 and average 1 over the batch; if every raw weight is 0 (mode `pow` with all
    rewards 0) all weights are 0 and the batch trains nothing but the KL term.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    # N >= 2 is the config's bound; the dock hands out whole groups
    assert group_size >= 2 and rewards.numel() % group_size == 0, f"{rewards.numel()} rewards in groups of {group_size}"
    groups = rewards.float().view(-1, group_size)  # (G, N)
    raw = FILTRATION_MODES.get(mode)(groups, power=power, generator=generator).view(-1)  # (B,)
    total = raw.sum()
    return raw * (raw.numel() / total) if total > 0 else raw
