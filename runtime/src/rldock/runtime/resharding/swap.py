"""Step 3 and its reverse: training params, grads and optimizer state device -> host and back,
keeping every tensor object (and its shape, views and optimizer references) as it is.

Only storages move: a tensor's bytes are copied into one reusable host buffer and its storage is
resized to zero, which hands the memory back to the allocator while the tensor object lives on;
swapping in resizes the storage and copies the bytes back, so the optimizer and autograd see the
same tensors as before. The host buffer is pinned on CUDA/NPU (required for asynchronous copies);
on CPU pinning needs an accelerator runtime, so it is plain memory there, and a "device -> host"
copy is a copy inside the same RAM (see `ledger` for how placement is accounted on CPU).

Swapping in can run in the background (`SwapIn`): on an accelerator on a side stream, on CPU in a
thread, so the copy overlaps the old-log-prob / reference inference that runs before the update.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rldock.runtime.resharding.parallelize import local_tensor

TRAIN_STATE_CATEGORIES = ("train_params", "grads", "optimizer_state")


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """This rank's training tensors by category (local shards of DTensors)."""
    params = list(model.parameters())
    device = params[0].device
    state = [
        local_tensor(value)
        for per_param in optimizer.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor) and value.device == device
    ]  # step counters may live on host
    return {
        "train_params": [local_tensor(p.detach()) for p in params],
        "grads": [local_tensor(p.grad) for p in params if p.grad is not None],
        "optimizer_state": state,
    }


@torch.no_grad()
def make_storages_resizable(model: nn.Module) -> int:
    """Give every parameter whose storage cannot be resized (weights that `from_pretrained` maps
    straight from a safetensors file) a copy in ordinary memory, keeping the Parameter object.
    Call before the swap; returns how many parameters were copied."""
    copied = 0
    for param in model.parameters():
        if not local_tensor(param.data).untyped_storage().resizable():
            assert not isinstance(param.data, DTensor), "DTensor shards are allocated by torch, always resizable"
            param.data = param.data.clone()
            copied += 1
    return copied


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int  # in the host buffer


class TensorSwapper:
    """Moves the storages of given tensors out to one host buffer and back in, by category."""

    def __init__(self, *, pin_memory: bool):
        self.pin_memory = pin_memory
        self.host = torch.empty(0, dtype=torch.uint8)
        self._slots: dict[str, list[_Slot]] = {}

    def holds(self, category: str) -> bool:
        """Whether `category`'s storages are on the host now (swapped out, not yet back)."""
        return category in self._slots

    @property
    def swapped_bytes(self) -> int:
        return sum(slot.nbytes for slots in self._slots.values() for slot in slots)

    def swap_out(self, tensors_by_category: Mapping[str, Sequence[torch.Tensor]]) -> int:
        """Copy every distinct storage to host and free it on the device; returns the bytes moved."""
        if self._slots:
            raise RuntimeError("swap_out called twice without swap_in: training state is already on host")
        seen: set[int] = set()
        plan: dict[str, list[_Slot]] = {}
        offset = 0
        for category, tensors in tensors_by_category.items():
            plan[category] = []
            for tensor in tensors:
                storage = tensor.untyped_storage()
                if storage.nbytes() == 0 or storage.data_ptr() in seen:
                    continue  # already out, or shared with a tensor seen earlier (tied weights)
                if not storage.resizable():
                    raise RuntimeError(
                        f"a {category} tensor of shape {tuple(tensor.shape)} has a storage that "
                        "cannot be freed (memory-mapped); call make_storages_resizable first"
                    )
                seen.add(storage.data_ptr())
                plan[category].append(_Slot(storage, storage.nbytes(), offset))
                offset += storage.nbytes()
        if offset > self.host.numel():
            # Allocated once and reused: pinned allocation is slow, and the set of tensors only
            # grows after the first optimizer step creates the optimizer state.
            self.host = torch.empty(offset, dtype=torch.uint8, pin_memory=self.pin_memory)
        slots = [slot for category_slots in plan.values() for slot in category_slots]
        for slot in slots:
            self.host[slot.offset : slot.offset + slot.nbytes].copy_(
                _bytes_view(slot.storage), non_blocking=self.pin_memory
            )
        if slots and slots[0].storage.device.type != "cpu":
            torch.get_device_module(slots[0].storage.device.type).synchronize()
        for slot in slots:
            slot.storage.resize_(0)
        self._slots = plan
        return offset

    def swapped(self) -> dict[str, list[torch.Tensor]]:
        """What is on host now, by category, as byte views that `swap_out` takes again once the
        storages are back (the tensors themselves are not kept here)."""
        return {category: [_bytes_view(slot.storage) for slot in slots] for category, slots in self._slots.items()}

    def swap_in(self, categories: Iterable[str] | None = None) -> int:
        """Restore the storages of `categories` (all by default); returns the bytes moved."""
        moved = 0
        for category in list(self._slots if categories is None else categories):
            for slot in self._slots.pop(category, []):
                slot.storage.resize_(slot.nbytes)
                _bytes_view(slot.storage).copy_(
                    self.host[slot.offset : slot.offset + slot.nbytes], non_blocking=self.pin_memory
                )
                moved += slot.nbytes
        return moved


class SwapIn:
    """A swap-in running in the background; `wait()` before the restored tensors are used.

    On an accelerator the copies go on a side stream and `wait` makes the current stream wait
    for them; on CPU they run in a thread (torch copies release the GIL).
    """

    def __init__(self, swapper: TensorSwapper, categories: Sequence[str], *, device: torch.device):
        self.bytes_moved = 0
        self._thread: threading.Thread | None = None
        self._event = None
        self._device = device
        if device.type == "cpu":
            self._thread = threading.Thread(target=self._run, args=(swapper, categories), daemon=True)
            self._thread.start()
            return
        module = torch.get_device_module(device.type)
        stream = module.Stream(device=device)
        stream.wait_stream(module.current_stream(device))
        with module.stream(stream):
            self._run(swapper, categories)
            self._event = stream.record_event()

    def _run(self, swapper: TensorSwapper, categories: Sequence[str]) -> None:
        self.bytes_moved = swapper.swap_in(categories)

    def wait(self) -> int:
        if self._thread is not None:
            self._thread.join()
        if self._event is not None:
            torch.get_device_module(self._device.type).current_stream(self._device).wait_event(self._event)
        return self.bytes_moved
