"""Who holds what: the training layout (TP x DP), the generation layout (TP x DP) over the same
ranks, and which decoder weights (Llama, Qwen2, Qwen3) are split along which dimension, kept as data.

Ranks are TP-major inside a DP replica (rank = dp_rank * tp_size + tp_rank), the usual order, so a
TP group is a run of consecutive ranks and its collectives stay on one node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

TpStyle = Literal["colwise", "rowwise"]

# Decoder-layer linears (the same names in Llama, Qwen2 and Qwen3) and how tensor parallelism
# splits them (Megatron style): colwise splits the output features (weight dim 0, bias dim 0),
# rowwise the input features (weight dim 1; its bias, absent in o_proj/down_proj, would stay whole). Embeddings, norms and the tied
# lm_head are not in the map and stay replicated.
DECODER_TP_PLAN: dict[str, TpStyle] = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}

# Replicated decoder-layer modules that see only this rank's heads (Qwen3's per-head q/k RMSNorms,
# applied after the colwise q/k projections): each TP rank's gradient for them is a partial sum
# over its heads, so the gradients are summed over the `tp` group before the update.
TP_PARTIAL_GRADIENT_MODULES = ("self_attn.q_norm", "self_attn.k_norm")

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def has_partial_gradient(name: str) -> bool:
    """True for a replicated HF parameter whose TP-rank gradient covers only that rank's heads."""
    match = _LAYER.match(name)
    return match is not None and match.group(2) in TP_PARTIAL_GRADIENT_MODULES


def shard_dim(name: str) -> int | None:
    """The dimension along which TP splits the HF parameter `name`, or None when replicated."""
    match = _LAYER.match(name)
    if match is None:
        return None
    style = DECODER_TP_PLAN.get(match.group(2))
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

    def dp_group_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same TP shard in every replica (gradients average over these)."""
        return list(range(self.tp_rank(rank), self.world_size, self.tp_size))


@dataclass(frozen=True)
class ReshardPlan:
    """Training layout -> generation layout over the same ranks."""

    train: ParallelLayout
    generate: ParallelLayout

    def __post_init__(self) -> None:
        if self.train.world_size != self.generate.world_size:
            raise ValueError(
                f"training TP x DP = {self.train.tp_size} x {self.train.dp_size} and generation TP x DP "
                f"= {self.generate.tp_size} x {self.generate.dp_size} must cover the same ranks")
