"""The memory ledger: per rank, device-resident bytes by category at every stage boundary.

A tensor counts in its category by the bytes of its storage while that storage is allocated on
the device (a swapped-out tensor has a zero-byte storage; a storage shared by several tensors
counts once). On CUDA/NPU the allocator's own counter (`memory_allocated`) is recorded beside the
categories, so the categorised bytes can be checked against what the device really holds.

On CPU the host and the "device" are the same RAM, so there is no allocator counter that could
separate them: the ledger accounts tensors by their logical placement instead. The training
tensors, generation weights and temporary buffer are "device"; the swap's host buffer is "host"
(reported as `host_swap`) though it is the same kind of memory. The CPU figures say how much
training state a device would hold, not how much RAM the process uses.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

CATEGORIES = ("train_params", "grads", "optimizer_state", "generation_weights", "temp_buffer", "kv_cache")
TRAIN_STATE = ("train_params", "grads", "optimizer_state")


def resident_bytes(tensors: Iterable[torch.Tensor], *, device_type: str, seen: set[int] | None = None) -> int:
    """Bytes of the distinct allocated storages of `tensors` on `device_type`.

    `seen` (storage addresses) is shared across calls so that a storage counts in one category only.
    """
    seen = set() if seen is None else seen
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.device.type != device_type or storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def ledger_entry(
    stage: str,
    tensors_by_category: Mapping[str, Iterable[torch.Tensor]],
    *,
    device: torch.device,
    kv_cache_bytes: int = 0,
    host_swap_bytes: int = 0,
) -> dict:
    """One ledger row: {"stage", "device_bytes": {category: bytes}, "host_swap", "allocator"}.

    `kv_cache_bytes` comes from the engine (its cache is not a tensor set the ledger can see);
    `allocator` is the allocator's counter on CUDA/NPU and None on CPU.
    """
    unknown = set(tensors_by_category) - set(CATEGORIES)
    assert not unknown, f"unknown ledger categories {sorted(unknown)}"
    seen: set[int] = set()
    device_bytes = {
        category: resident_bytes(tensors_by_category.get(category, ()), device_type=device.type, seen=seen)
        for category in CATEGORIES
        if category != "kv_cache"
    }
    device_bytes["kv_cache"] = int(kv_cache_bytes)
    allocator = None
    if device.type != "cpu":
        allocator = int(torch.get_device_module(device.type).memory_allocated(device))
    return {"stage": stage, "device_bytes": device_bytes, "host_swap": int(host_swap_bytes), "allocator": allocator}


def train_state_bytes(entry: dict) -> int:
    return sum(entry["device_bytes"][category] for category in TRAIN_STATE)


def ledger_metrics(entries: Iterable[dict], *, rank: int) -> dict[str, int]:
    """Flat metric names for the metrics log: `memory/rank{r}/{stage}/{category}` in bytes."""
    metrics: dict[str, int] = {}
    for entry in entries:
        prefix = f"memory/rank{rank}/{entry['stage']}"
        for category, nbytes in entry["device_bytes"].items():
            metrics[f"{prefix}/{category}"] = nbytes
        metrics[f"{prefix}/host_swap"] = entry["host_swap"]
        if entry["allocator"] is not None:
            metrics[f"{prefix}/allocator"] = entry["allocator"]
    return metrics
