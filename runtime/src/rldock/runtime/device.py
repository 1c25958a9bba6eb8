"""The device seam: which accelerator this process trains and generates on, and its collective backend.

This is the only module that knows device kinds. Everything else takes a `DeviceInfo` and uses its
`torch_device` and `backend`, so running on Ascend NPU, CUDA or CPU is one config field
(`resources.device`), never an `if npu:` branch elsewhere.

`torch_npu` is imported lazily: it is absent on CPU/CUDA machines, and importing it registers the
`npu` device with torch (`torch.npu`), which is what `detect_device` then queries.

The npu twin (a test double outside the product, `rldock_e2e.doubles.npu_twin`) registers a
`torch.npu` of its own that marks itself with `TWIN = True`. It is an Ascend device here in every
respect but the kernels: the same `npu:N` tensors, allocator counters, pinned buffers, streams and
code paths. The only substitutions are `TWIN_SUBSTITUTES`, read through `DeviceInfo`.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

DeviceKind = Literal["npu", "cuda", "cpu"]

# Collective backend per device kind: HCCL on Ascend, NCCL on NVIDIA, gloo on CPU.
BACKENDS: dict[str, str] = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
REQUESTABLE = ("auto", "npu", "cuda", "cpu")
# The variable that limits which accelerators a process (and the processes it starts) may use; Ray
# sets it to each actor's own device. The CPU has none.
VISIBLE_DEVICES_ENVS: dict[str, str] = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}

# What the npu twin replaces, and with what (nothing else may branch on the twin):
# - HCCL -> gloo: npu tensors are staged through host memory by the twin's `hccl_twin` backend,
#   host tensors go to gloo, as "cpu:gloo,npu:hccl" would split them on Ascend;
# - vllm-ascend -> vLLM's CPU engine: generation runs the CPU platform's engine (its weights come
#   from the npu tensors, so the device -> engine weight path still runs).
TWIN_SUBSTITUTES = {"backend": "cpu:gloo,npu:hccl_twin", "engine_kind": "cpu"}


@dataclass(frozen=True)
class DeviceInfo:
    """Where this process computes.

    `torch_device` is the device string tensors go to ("npu:0", "cuda:0", "cpu"); on accelerators
    the index is the local one, because Ray (and the device plugin) expose only this actor's
    devices through ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES.
    """

    kind: DeviceKind
    torch_device: str
    backend: str
    twin: bool = False  # the npu twin (see TWIN_SUBSTITUTES)

    @property
    def engine_kind(self) -> DeviceKind:
        """The platform the rollout engine runs on: the device's own, the CPU's for the twin."""
        return TWIN_SUBSTITUTES["engine_kind"] if self.twin else self.kind  # type: ignore[return-value]

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    @property
    def device_index(self) -> int | None:
        # Parsed by hand: torch.device("npu:0") only parses once torch_npu is imported.
        _, _, index = self.torch_device.partition(":")
        return int(index) if index else None


def _npu_twin_active() -> bool:
    return bool(getattr(getattr(torch, "npu", None), "TWIN", False))


def _npu_available() -> bool:
    """True when torch_npu imports and sees an NPU; importing it registers `torch.npu`."""
    if _npu_twin_active():  # the twin is chosen by name only, never by `auto` (see detect_device)
        return False
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        # Expected on every non-Ascend machine; narrow on purpose so a broken CANN install
        # (OSError from a missing libhccl, say) surfaces instead of silently falling back to CPU.
        return False
    return bool(torch.npu.is_available())  # type: ignore[attr-defined]


def _cuda_available() -> bool:
    return torch.cuda.is_available()


_PROBES = {"npu": _npu_available, "cuda": _cuda_available, "cpu": lambda: True}


def _info(kind: DeviceKind, index: int) -> DeviceInfo:
    torch_device = "cpu" if kind == "cpu" else f"{kind}:{index}"
    if kind == "npu" and _npu_twin_active():
        return DeviceInfo(kind=kind, torch_device=torch_device, backend=TWIN_SUBSTITUTES["backend"], twin=True)
    return DeviceInfo(kind=kind, torch_device=torch_device, backend=BACKENDS[kind])


class DeviceUnavailable(RuntimeError):
    """A requested device kind this machine cannot provide; `kind` and `why` let a caller that
    takes the kind from elsewhere than resources.device (a CLI flag) name its own field."""

    def __init__(self, kind: str, why: str):
        super().__init__(
            f"resources.device={kind!r} was requested but is not available here: {why}. "
            "Set resources.device to 'auto' or 'cpu' to run without it."
        )
        self.kind, self.why = kind, why


def detect_device(requested: str = "auto", *, index: int = 0) -> DeviceInfo:
    """Resolve `resources.device` to a `DeviceInfo`.

    `auto` picks npu, then cuda, then cpu. An explicitly requested kind that this machine cannot
    provide raises `DeviceUnavailable` (a `RuntimeError`) naming the field, instead of quietly training on the CPU.
    `index` is the local device index (0 for an actor that was given one device).
    The npu twin answers only an explicit `npu`: `auto` on a machine without hardware stays CPU
    even in a process where a test installed the twin.
    """
    assert requested in REQUESTABLE, f"device kind {requested!r} is none of {REQUESTABLE} (resources.device's values)"
    if requested == "auto":
        for kind in ("npu", "cuda"):
            if _PROBES[kind]():
                info = _info(kind, index)
                logger.info("resources.device=auto resolved to %s", info.torch_device)
                return info
        return _info("cpu", index)
    if requested == "npu" and _npu_twin_active():
        return _info("npu", index)
    if not _PROBES[requested]():
        hint = {
            "npu": "torch_npu is not installed or sees no NPU (is CANN set up and the NPU visible?)",
            "cuda": "torch.cuda.is_available() is False (CPU-only torch build or no visible GPU)",
        }[requested]
        raise DeviceUnavailable(requested, hint)
    return _info(requested, index)  # type: ignore[arg-type]
