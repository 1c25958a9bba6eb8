"""Step 2: each generation rank takes exactly its shard of the gathered weights and loads it into
its engine in place.

Slices are views into the temporary buffer (no copy until the engine's own copy). `GenerationWeights`
is the generation side as plain preallocated tensors at the generation layout's shard shapes: it
stands in for an engine in the tests and the benchmark. The vLLM engine
(`VllmRolloutEngine.update_weights`) is the real target: one engine per generation replica, on the
replica's first rank, which hands it the full views (sliced at TP 1), and vLLM's own weight loaders
narrow them to each of its TP workers (`rollout.tensor_parallel_size`, docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from rldock.contract.tensor_parallel import TpPlan
from rldock.runtime.resharding.gather import GatheredWeights
from rldock.runtime.resharding.parallel_layout import shard_dim


def generation_shard(name: str, full: torch.Tensor, *, tp_rank: int, tp_size: int, plan: TpPlan | None) -> torch.Tensor:
    """The part of the full parameter `name` that generation TP rank `tp_rank` of `tp_size` holds
    under `plan` (a view; the whole tensor when the parameter is replicated). `plan` may be None
    only at TP 1 (an architecture without a plan)."""
    if tp_size == 1:
        return full
    assert plan is not None, "generation TP > 1 needs the architecture's plan"
    dim = shard_dim(name, plan)
    if dim is None:
        return full
    size = full.shape[dim] // tp_size
    assert size * tp_size == full.shape[dim], f"{name} dim {dim} does not split over {tp_size}"
    return full.narrow(dim, tp_rank * size, size)


def generation_items(
    gathered: GatheredWeights, *, tp_rank: int, tp_size: int, plan: TpPlan | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, this generation rank's shard) for every gathered parameter."""
    for name, full in gathered.views.items():
        yield name, generation_shard(name, full, tp_rank=tp_rank, tp_size=tp_size, plan=plan)


class GenerationWeights:
    """Generation-layout weights held as preallocated tensors, updated in place by `load`."""

    def __init__(
        self,
        shapes: dict[str, tuple[int, ...]],
        *,
        dtype: torch.dtype,
        device: torch.device,
        tp_rank: int,
        tp_size: int,
        plan: TpPlan | None,
    ):
        self.tensors: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            full = torch.empty(shape, dtype=dtype, device="meta")
            local_shape = generation_shard(name, full, tp_rank=tp_rank, tp_size=tp_size, plan=plan).shape
            self.tensors[name] = torch.empty(local_shape, dtype=dtype, device=device)

    @torch.no_grad()
    def load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, value in items:
            target = self.tensors.get(name)
            if target is None or target.shape != value.shape:
                raise ValueError(
                    f"generation weight {name}: expected "
                    f"{None if target is None else tuple(target.shape)}, got {tuple(value.shape)}"
                )
            target.copy_(value)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
