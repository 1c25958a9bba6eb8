"""The npu twin behaves as an accelerator where placement matters: its own device, the same
mismatch errors, per-device memory counters, pinned host memory, streams and events; and the device
seam resolves an explicit `npu` to it (Ascend's code path, with the twin's two substitutions) while
`auto` stays on the CPU."""

from __future__ import annotations

import pytest
import torch

from rldock.runtime.device import TWIN_SUBSTITUTES, detect_device


def test_twin_tensors_are_not_cpu_tensors_and_mixing_fails_as_on_hardware(npu_twin):
    a = torch.randn(3, 4).to("npu:0")
    assert a.device == torch.device("npu:0") and a.is_npu and not a.is_cpu
    with pytest.raises(RuntimeError, match="same device.*npu:0 and cpu"):
        a + torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="same device"):
        torch.nn.Linear(4, 2).to("npu:1")(a)
    with pytest.raises(RuntimeError, match="same device"):
        torch.nn.Embedding(8, 4).to("npu:0")(torch.tensor([1, 2]))  # host token ids into a device model
    assert (a * torch.tensor(2.0)).device == a.device  # a 0-dim host tensor is a scalar, as on CUDA/NPU
    assert a[torch.tensor([0, 2])].device == a.device  # host index tensors are accepted, as on CUDA/NPU
    torch.testing.assert_close((a + a).cpu(), 2 * a.cpu())


def test_views_and_factories_stay_on_their_device(npu_twin):
    x = torch.arange(3, device="npu:1")  # an out= kernel underneath: its output grows on npu:1
    assert x.untyped_storage().device == torch.device("npu:1")
    assert x[None, :].device == x.unsqueeze(0).device == torch.device("npu:1")


def test_memory_is_counted_per_device(npu_twin):
    before = [npu_twin.memory_allocated(f"npu:{i}") for i in (6, 7)]
    x = torch.empty(1000, dtype=torch.float32, device="npu:6")
    assert npu_twin.memory_allocated("npu:6") - before[0] == 4000
    assert npu_twin.memory_allocated("npu:7") == before[1]
    assert npu_twin.max_memory_allocated("npu:6") >= before[0] + 4000
    del x
    assert npu_twin.memory_allocated("npu:6") == before[0]
    npu_twin.reset_peak_memory_stats("npu:6")
    assert npu_twin.max_memory_allocated("npu:6") == before[0]


def test_pinned_host_memory_and_streams(npu_twin):
    pinned_before = npu_twin.pinned_memory_bytes()
    host = torch.empty(256, dtype=torch.uint8, pin_memory=True)
    assert host.is_pinned() and host.is_cpu and npu_twin.pinned_memory_bytes() - pinned_before == 256
    assert not torch.empty(8).is_pinned()
    side = npu_twin.Stream(device="npu:0")
    side.wait_stream(npu_twin.current_stream("npu:0"))
    with npu_twin.stream(side):
        assert npu_twin.current_stream("npu:0") is side
        device_copy = host.to("npu:0", non_blocking=True)
        done = side.record_event()
    npu_twin.current_stream("npu:0").wait_event(done)
    assert npu_twin.current_stream("npu:0") is npu_twin.default_stream("npu:0")
    assert torch.equal(device_copy.cpu(), host)
    npu_twin.synchronize()


def test_device_seam_resolves_npu_to_the_twin_and_auto_to_the_cpu(npu_twin):
    info = detect_device("npu", index=2)
    assert (info.kind, info.torch_device, info.twin) == ("npu", "npu:2", True)
    assert info.backend == TWIN_SUBSTITUTES["backend"] and info.engine_kind == "cpu"
    assert info.is_accelerator and info.device_index == 2
    assert detect_device("auto").kind == "cpu"
    assert npu_twin.device_count() == 8  # an 8-device node unless ASCEND_RT_VISIBLE_DEVICES says less
