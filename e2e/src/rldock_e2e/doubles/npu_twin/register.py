"""Install the twin into this process as the `npu` device (idempotent)."""

from __future__ import annotations

import torch

from rldock_e2e.doubles.npu_twin import collectives, device_module
from rldock_e2e.doubles.npu_twin.build import load_extension


def activate() -> None:
    """Make `npu` a device of this process; raises TwinUnavailable where it cannot be built.

    Refuses to run beside torch_npu: a process has one PrivateUse1 backend.
    """
    if device_module._ext is not None:
        return
    if hasattr(torch, "npu") and torch.npu is not device_module:
        raise RuntimeError("torch.npu is already registered (torch_npu is loaded); the twin needs a process without it")
    extension = load_extension()
    extension.install()
    torch.utils.rename_privateuse1_backend("npu")
    device_module._ext = extension
    torch._register_device_module("npu", device_module)
    torch.utils.generate_methods_for_privateuse1_backend(for_tensor=True, for_module=True, for_storage=True)
    collectives.register(extension)
