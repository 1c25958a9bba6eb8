"""The twin's stand-in for HCCL: a process-group backend for npu tensors that stages every
collective through host memory and runs it over gloo.

Registered as the `hccl_twin` backend for the `npu` device, so `init_process_group` with
"cpu:gloo,npu:hccl_twin" routes npu tensors here and host tensors to gloo, as "cpu:gloo,npu:hccl"
would with torch_npu. Only the collectives rldock and DDP use are implemented.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

BACKEND_NAME = "hccl_twin"


def _done(result) -> dist.Work:
    future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


def _to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().to("cpu") for t in tensors]


def _copy_back(devices: list[torch.Tensor], hosts: list[torch.Tensor]) -> None:
    for device_tensor, host in zip(devices, hosts):
        device_tensor.copy_(host)


class HostStagedGloo(dist.ProcessGroup):
    """Each collective: device -> host copies, the gloo collective, host -> device copies."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("hccl_twin", store), rank, size, timeout)

    def getBackendName(self) -> str:  # c10d's name for it
        return BACKEND_NAME

    def allreduce(self, tensors, opts):
        hosts = _to_host(tensors)
        self._gloo.allreduce(hosts, opts).wait()
        _copy_back(tensors, hosts)
        return _done(tensors)

    def broadcast(self, tensors, opts):
        hosts = _to_host(tensors)
        self._gloo.broadcast(hosts, opts).wait()
        _copy_back(tensors, hosts)
        return _done(tensors)

    def allgather(self, output_lists, inputs, opts):
        host_outputs = [_to_host(outputs) for outputs in output_lists]
        self._gloo.allgather(host_outputs, _to_host(inputs), opts).wait()
        for outputs, hosts in zip(output_lists, host_outputs):
            _copy_back(outputs, hosts)
        return _done(output_lists)

    def _allgather_base(self, output, input, opts):
        host_output = output.detach().to("cpu")
        self._gloo._allgather_base(host_output, input.detach().to("cpu"), opts).wait()
        output.copy_(host_output)
        return _done(output)

    def barrier(self, opts):
        return self._gloo.barrier(opts)


def create(store, rank: int, size: int, timeout) -> HostStagedGloo:
    return HostStagedGloo(store, rank, size, timeout)


def register() -> None:
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, create, devices=["npu"])
