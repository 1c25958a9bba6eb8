"""`torch.npu` for the twin: the subset of torch_npu's device-module API that rldock and its tests
use, with the same names and signatures (device_count, set_device, current_device, synchronize,
Stream, Event, stream, memory_allocated, max_memory_allocated, reset_peak_memory_stats, ...).

The twin computes synchronously, so every stream is always idle and every event has completed
when recorded; streams keep identity and device, and `stream(s)` makes `s` current, so code that
routes copies through a side stream runs its real control flow.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

TWIN = True  # read by rldock.runtime.device: Ascend in every respect but the kernels
_ext = None  # the compiled extension, set by register.activate
_local = threading.local()


def _index(device: torch.device | str | int | None) -> int:
    if device is None:
        return _ext.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "npu":
        raise ValueError(f"expected an npu device, got {device}")
    return _ext.current_device() if device.index is None else device.index


def is_available() -> bool:
    return _ext is not None and _ext.device_count() > 0


def is_initialized() -> bool:
    return _ext is not None


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return _ext.device_count()


def current_device() -> int:
    return _ext.current_device()


def set_device(device: torch.device | str | int) -> None:
    _ext.set_device(_index(device))


class device:  # torch_npu's name (a lower-case class)
    """Context manager: make `index` the current device inside the block."""

    def __init__(self, index: torch.device | str | int | None):
        self.index = None if index is None else _index(index)
        self.previous = -1

    def __enter__(self):
        self.previous = _ext.current_device()
        if self.index is not None:
            _ext.set_device(self.index)

    def __exit__(self, *exc) -> None:
        _ext.set_device(self.previous)


def synchronize(device: torch.device | str | int | None = None) -> None:
    _index(device)  # validates; nothing is ever in flight


def memory_allocated(device: torch.device | str | int | None = None) -> int:
    """Bytes of live tensor storage on `device`, counted by the twin's allocator."""
    return _ext.memory_allocated(_index(device))


def max_memory_allocated(device: torch.device | str | int | None = None) -> int:
    return _ext.max_memory_allocated(_index(device))


def reset_peak_memory_stats(device: torch.device | str | int | None = None) -> None:
    _ext.reset_peak_memory_stats(_index(device))


def pinned_memory_bytes() -> int:
    """Twin only: bytes of live pinned host memory (torch_npu has no such counter)."""
    return _ext.pinned_bytes()


def manual_seed(seed: int) -> None:
    """Kernels run on the CPU, so the CPU generator is the device's."""


def manual_seed_all(seed: int) -> None:
    """See manual_seed."""


class Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with enable_timing=True")
        return (end_event._time - self._time) * 1000.0


class Stream:
    def __init__(self, device: torch.device | str | int | None = None, priority: int = 0):
        self.device = torch.device("npu", _index(device))
        self.priority = priority

    def wait_stream(self, stream: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<torch.npu.Stream (twin) device={self.device} at {id(self):#x}>"


def _current() -> dict[int, Stream]:
    if not hasattr(_local, "streams"):
        _local.streams = {}
    return _local.streams


def default_stream(device: torch.device | str | int | None = None) -> Stream:
    index = _index(device)
    defaults = globals().setdefault("_defaults", {})
    if index not in defaults:
        defaults[index] = Stream(index)
    return defaults[index]


def current_stream(device: torch.device | str | int | None = None) -> Stream:
    index = _index(device)
    return _current().get(index) or default_stream(index)


def set_stream(stream: Stream) -> None:
    _current()[stream.device.index] = stream


@contextlib.contextmanager
def stream(stream: Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    previous = current_stream(stream.device)
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(previous)
