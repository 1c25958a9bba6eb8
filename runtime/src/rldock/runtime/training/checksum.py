"""The whole model's weight sum whatever its layout: a cheap read, once per update, that shows a
rank whose weights drifted from its peers' or a resume that restored different weights."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement


@torch.no_grad()
def weights_sum(model: nn.Module, *, stages: dist.ProcessGroup | None = None) -> float:
    """The sum of every parameter of the whole model, in float64. A parameter held whole (DDP, a
    lone rank) adds its own sum: each replica reads its own, so ranks that drifted apart disagree.
    A DTensor (FSDP's shards, TP's split layers) adds its shards' sums over the ranks of its mesh
    (counted once where it is replicated), one all-reduce per mesh and layout: collective, the
    same on every rank, and changed by any shard that was lost or loaded wrong. `stages`: the
    pipeline group of a model cut into stages (training/pipeline.py), whose sums add up to the whole
    model's (an untied model's: a tied one's head copy would count twice)."""
    terms = [float(p.double().sum()) for p in model.parameters() if not isinstance(p, DTensor)]
    sharded: dict[tuple[DeviceMesh, tuple[Placement, ...]], list[torch.Tensor]] = {}
    for param in model.parameters():
        if isinstance(param, DTensor):
            sharded.setdefault((param.device_mesh, tuple(param.placements)), []).append(param.to_local().double().sum())
    for (mesh, placements), sums in sharded.items():
        # Each rank's sums of its shards, reduced as a partial sum over the dims that shard them;
        # on the mesh's device (an offloaded shard lives on the host, its collectives do not).
        local = torch.stack(sums).to(mesh.device_type)  # (parameters,)
        partial = [Partial() if placement.is_shard() else placement for placement in placements]
        terms.extend(DTensor.from_local(local, mesh, partial, run_check=False).full_tensor().tolist())
    if stages is None:
        return math.fsum(terms)
    every: list[list[float] | None] = [None] * dist.get_world_size(stages)
    dist.all_gather_object(every, terms, group=stages)  # each stage's terms, summed alike on every rank
    return math.fsum(term for stage_terms in every for term in stage_terms or ())
