"""The device seam: auto-detection order, refusing unavailable kinds, backends and memory."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from rldock.runtime import device as device_mod
from rldock.runtime.device import DeviceInfo, detect_device


@pytest.fixture(autouse=True)
def _no_npu_twin(monkeypatch):
    """These tests are about the real probes: an npu twin installed earlier in this test process
    (tests/unit/runtime/twin) must not answer for them."""
    monkeypatch.setattr(device_mod, "_npu_twin_active", lambda: False)


def test_auto_on_this_machine_is_cpu_with_gloo():
    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    info = detect_device("auto")
    assert info == DeviceInfo(kind="cpu", torch_device="cpu", backend="gloo")
    assert not info.is_accelerator
    assert info.device_index is None


@pytest.mark.parametrize(
    ("npu", "cuda", "expected"),
    [
        (True, True, DeviceInfo("npu", "npu:0", "hccl")),
        (False, True, DeviceInfo("cuda", "cuda:0", "nccl")),
        (False, False, DeviceInfo("cpu", "cpu", "gloo")),
    ],
)
def test_auto_prefers_npu_then_cuda_then_cpu(monkeypatch, npu, cuda, expected):
    monkeypatch.setitem(device_mod._PROBES, "npu", lambda: npu)
    monkeypatch.setitem(device_mod._PROBES, "cuda", lambda: cuda)
    assert detect_device("auto") == expected


def test_index_names_the_local_device(monkeypatch):
    monkeypatch.setitem(device_mod._PROBES, "npu", lambda: True)
    info = detect_device("npu", index=3)
    assert (info.torch_device, info.device_index, info.is_accelerator) == ("npu:3", 3, True)


@pytest.mark.parametrize("kind", ["npu", "cuda"])
def test_requested_kind_that_is_missing_names_the_field(monkeypatch, kind):
    monkeypatch.setitem(device_mod._PROBES, kind, lambda: False)
    with pytest.raises(RuntimeError, match=rf"resources\.device='{kind}'"):
        detect_device(kind)


def test_npu_probe_is_false_without_torch_npu():
    # The real probe, on machines where torch_npu is not installed (it cannot be without CANN).
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed")
    assert device_mod._npu_available() is False


def test_npu_probe_imports_torch_npu_then_asks_torch_npu_device(monkeypatch):
    # Stand-ins for what importing torch_npu provides: the module and the torch.npu namespace.
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_available=lambda: True), raising=False)
    assert device_mod._npu_available() is True
    assert detect_device("auto").kind == "npu"
