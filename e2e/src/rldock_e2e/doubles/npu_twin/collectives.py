"""The twin's stand-in for HCCL: the `hccl_twin` process-group backend for npu tensors, which stages
every collective through host memory and runs it over gloo (hccl_twin.cpp).

Registered for the `npu` device, so `init_process_group` with "cpu:gloo,npu:hccl_twin" routes npu
tensors here and host tensors to gloo, as "cpu:gloo,npu:hccl" would with torch_npu. The collectives
DDP and FSDP2 use are implemented: broadcast, all-reduce, all-gather (list, into one tensor,
coalesced), reduce-scatter into one tensor (and coalesced), barrier; all-to-all with uneven splits
(expert parallelism's dispatch); and scatter (a tensor-parallel plan's weights, cut on one rank).

It is a C++ backend because c10d reaches a Python process group only from Python: DTensor's and
FSDP2's functional collectives dispatch in C++ to the group's backend for the tensor's device.
"""

from __future__ import annotations

from types import ModuleType

import torch.distributed as dist

BACKEND_NAME = "hccl_twin"


def register(extension: ModuleType) -> None:
    """Make `hccl_twin` a torch.distributed backend for npu tensors (once per process)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return

    def create(store, rank: int, size: int, timeout):
        gloo = dist.ProcessGroupGloo(dist.PrefixStore(BACKEND_NAME, store), rank, size, timeout)
        return extension.host_staged_backend(gloo)

    dist.Backend.register_backend(BACKEND_NAME, create, devices=["npu"])
