"""The `npu` device twin: a test double for an Ascend NPU that computes on the CPU (never shipped).

`activate()` builds (once, into the cache) and loads a small PrivateUse1 C++ extension
(`npu_twin.cpp`), renames PrivateUse1 to `npu` and registers `torch.npu` (`device_module`), so that
`torch.device("npu:0")` is a device of its own: tensors there are not CPU tensors, an op mixing them
with CPU tensors fails as on hardware, and every device byte is counted per device. Collectives on
npu tensors go through the `hccl_twin` backend (`collectives.py`, `hccl_twin.cpp`) (the twin's stand-in for HCCL).

What it is not: a model of NPU kernels, of asynchronous streams (it computes synchronously, so a
missing stream wait goes unseen) or of device memory limits. docs/accelerators.md lists what only
real hardware runs.
"""

from rldock_e2e.doubles.npu_twin.build import TwinUnavailable, cache_dir, load_extension
from rldock_e2e.doubles.npu_twin.register import activate

__all__ = ["TwinUnavailable", "activate", "cache_dir", "load_extension"]
