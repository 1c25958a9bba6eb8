"""Who holds what: the training layout (TP x DP), the generation layout (TP x DP) over the same
ranks, and which HF parameter a tensor-parallel plan (rldock.contract.tensor_parallel.TP_PLANS,
one per architecture) splits along which dimension.

Ranks are TP-major inside a DP replica (rank = dp_rank * tp_size + tp_rank), the usual order, so a
TP group is a run of consecutive ranks and its collectives stay on one node. The generation layout
uses the same order: a generation replica is `rollout.tensor_parallel_size` consecutive actor
ranks, and its first rank holds the replica's one vLLM engine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rldock.contract.tensor_parallel import TpPlan

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def has_partial_gradient(name: str, plan: TpPlan) -> bool:
    """True for a replicated HF parameter whose TP-rank gradient covers only that rank's heads."""
    match = _LAYER.match(name)
    return match is not None and match.group(2) in plan.partial_gradient_modules


def shard_dim(name: str, plan: TpPlan) -> int | None:
    """The dimension along which `plan` splits the HF parameter `name`, or None when replicated."""
    match = _LAYER.match(name)
    if match is None:
        return None
    style = plan.linears.get(match.group(2))
    if style == "colwise":
        return 0
    if style == "rowwise" and match.group(3) == "weight":
        return 1
    return None


@dataclass(frozen=True)
class ParallelLayout:
    """TP x DP over `tp_size * dp_size` ranks."""

    tp_size: int
    dp_size: int

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.dp_size < 1:
            raise ValueError(f"tp_size and dp_size must be >= 1, got {self.tp_size}, {self.dp_size}")

    @classmethod
    def over(cls, world_size: int, *, tp_size: int, field: str) -> ParallelLayout:
        """The layout of `world_size` ranks in TP groups of `tp_size` (raises naming `field` when
        `tp_size` does not divide them)."""
        if tp_size < 1 or world_size % tp_size:
            raise ValueError(f"{field}={tp_size} must divide the {world_size} actor ranks")
        return cls(tp_size=tp_size, dp_size=world_size // tp_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.dp_size

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp_size

    def tp_group_ranks(self, rank: int) -> list[int]:
        """The ranks holding the other TP shards of `rank`'s replica."""
        start = self.dp_rank(rank) * self.tp_size
        return list(range(start, start + self.tp_size))

    def leaders(self) -> list[int]:
        """Each replica's first rank (TP rank 0): in the generation layout, the ranks that hold
        an engine."""
        return list(range(0, self.world_size, self.tp_size))


@dataclass(frozen=True)
class ReshardPlan:
    """Training layout -> generation layout over the same ranks."""

    train: ParallelLayout
    generate: ParallelLayout

    def __post_init__(self) -> None:
        if self.train.world_size != self.generate.world_size:
            raise ValueError(
                f"training TP x DP = {self.train.tp_size} x {self.train.dp_size} and generation TP x DP "
                f"= {self.generate.tp_size} x {self.generate.dp_size} must cover the same ranks"
            )
