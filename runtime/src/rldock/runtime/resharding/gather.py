"""Step 1: allgather the training TP shards into a temporary buffer, one contiguous buffer per
dtype, communicating in buckets of a configurable size.

The buffer holds every parameter at full size (what the paper's allgather produces); each
parameter is a view into it, so step 2 slices views and step 4 frees the whole buffer at once.
Buckets bound the scratch memory of the collective (send + TP x receive) and let one
`all_gather_into_tensor` carry many small tensors. A parameter larger than the bucket gets a bucket
of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from rldock.runtime.resharding.parallelize import local_tensor


@dataclass(frozen=True)
class ParamEntry:
    """One parameter as this rank holds it, and where it goes in the gathered buffer."""

    name: str
    dtype: torch.dtype
    local_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    shard_dim: int | None  # None: replicated, no communication

    @property
    def full_numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def full_nbytes(self) -> int:
        return self.full_numel * self.dtype.itemsize


def param_entries(model: nn.Module) -> list[tuple[ParamEntry, torch.Tensor]]:
    """Every (deduplicated) parameter with its local shard; the shard dim comes from the DTensor
    placement, the training layout's own record of the split."""
    entries = []
    for name, param in model.named_parameters():
        shard = None
        if isinstance(param, DTensor):
            (placement,) = param.placements  # one mesh dimension: tp
            if isinstance(placement, Shard):
                shard = placement.dim
        local = local_tensor(param.detach())
        entries.append((ParamEntry(name, param.dtype, tuple(local.shape), tuple(param.shape), shard), local))
    return entries


def plan_buckets(entries: list[ParamEntry], bucket_bytes: int) -> list[list[ParamEntry]]:
    """Group entries, in order and per dtype, into buckets of at most `bucket_bytes` gathered bytes
    (an entry larger than that alone in its bucket)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[ParamEntry]] = []
    open_bucket: dict[torch.dtype, tuple[list[ParamEntry], int]] = {}
    for entry in entries:
        bucket, used = open_bucket.get(entry.dtype, ([], 0))
        if bucket and used + entry.full_nbytes > bucket_bytes:
            buckets.append(bucket)
            bucket, used = [], 0
        bucket.append(entry)
        open_bucket[entry.dtype] = (bucket, used + entry.full_nbytes)
    buckets.extend(bucket for bucket, _ in open_bucket.values() if bucket)
    return buckets


@dataclass
class GatheredWeights:
    """Full-size weights as views into one contiguous buffer per dtype (the temporary buffer)."""

    buffers: dict[torch.dtype, torch.Tensor]
    views: dict[str, torch.Tensor]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(buf.untyped_storage().nbytes() for buf in self.buffers.values())

    def free(self) -> None:
        """Step 4: release the buffers' memory now, even if a stray view still refers to them."""
        for buf in self.buffers.values():
            buf.untyped_storage().resize_(0)
        self.buffers.clear()
        self.views.clear()


def allocate_buffers(entries: list[ParamEntry], device: torch.device) -> GatheredWeights:
    """One buffer per dtype holding every entry at full size, in entry order."""
    totals: dict[torch.dtype, int] = {}
    for entry in entries:
        totals[entry.dtype] = totals.get(entry.dtype, 0) + entry.full_numel
    buffers = {dtype: torch.empty(total, dtype=dtype, device=device) for dtype, total in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    views = {}
    for entry in entries:
        start = offsets[entry.dtype]
        views[entry.name] = buffers[entry.dtype][start : start + entry.full_numel].view(entry.full_shape)
        offsets[entry.dtype] = start + entry.full_numel
    return GatheredWeights(buffers, views, {e.name: e.full_shape for e in entries})


@torch.no_grad()
def allgather_weights(
    model: nn.Module, *, tp_group: dist.ProcessGroup | None, tp_size: int, bucket_bytes: int
) -> GatheredWeights:
    """Gather every parameter of `model` at full size into the temporary buffer (collective over
    `tp_group`: every TP rank calls it with the same model structure)."""
    pairs = param_entries(model)
    locals_by_name = {entry.name: local for entry, local in pairs}
    entries = [entry for entry, _ in pairs]
    device = next(iter(locals_by_name.values())).device
    gathered = allocate_buffers(entries, device)
    for bucket in plan_buckets(entries, bucket_bytes):
        sharded = [e for e in bucket if e.shard_dim is not None]
        for entry in bucket:
            if entry.shard_dim is None:
                gathered.views[entry.name].copy_(locals_by_name[entry.name])
        if not sharded:
            continue
        send = torch.cat([locals_by_name[e.name].reshape(-1) for e in sharded])  # (s,)
        receive = torch.empty(tp_size * send.numel(), dtype=send.dtype, device=device)
        dist.all_gather_single(receive, send, group=tp_group)
        chunks = receive.view(tp_size, send.numel())  # (TP, s): row r is TP rank r's send
        offset = 0
        for entry in sharded:
            parts = [chunks[r, offset : offset + entry.local_numel].view(entry.local_shape) for r in range(tp_size)]
            assert entry.shard_dim is not None  # `sharded` holds the split entries only
            torch.cat(parts, dim=entry.shard_dim, out=gathered.views[entry.name])
            offset += entry.local_numel
    return gathered
