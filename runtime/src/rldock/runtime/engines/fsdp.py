"""FSDP2 for a trained model (`training.strategy: fsdp`): each decoder layer and then the root are
`fully_shard`ed over all ranks of the default group, so every rank holds 1/world of the parameters,
their gradients and (since the optimizer is built on the sharded parameters) the AdamW state.

A layer's full weights exist only while it computes (all-gathered before its forward and again
before its backward, freed after); gradients are reduce-scattered. Options are FSDP2 policies:
`CPUOffloadPolicy` keeps the shards, gradients and optimizer step on the host;
`MixedPrecisionPolicy` computes in bf16/fp16 while the float32 shards stay the master weights and
gradients are reduced in float32.

The rollout engine needs whole tensors under the HF names: `full_state_dict` all-gathers one tensor
at a time (collective: every rank iterates it), so the extra memory is one full tensor, not a
second model. `swap_out_shards`/`swap_in_shards` move this rank's shards, gradients and optimizer
state to the host during generation (allgather-swap from the FSDP layout, resharding/swap.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rldock.runtime.device import DeviceInfo
from rldock.runtime.models.layers import decoder_layers

COMPUTE_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_mixed_precision(mode: str, device: DeviceInfo) -> None:
    """Refuse a compute dtype the device cannot run. CPUs run bf16/fp16 in torch (slowly without
    AVX512-BF16/AMX); Ascend 910B runs both; older CUDA GPUs lack bf16."""
    dtype = COMPUTE_DTYPES[mode]
    if dtype is torch.bfloat16 and device.kind == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"training.mixed_precision: bf16 is not supported by {torch.cuda.get_device_name()}; use fp16 or none"
        )


def mixed_precision_policy(mode: str) -> MixedPrecisionPolicy:
    """Compute in `mode`'s dtype, reduce gradients in float32 (the shards' own dtype when `none`)."""
    dtype = COMPUTE_DTYPES[mode]
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module, device: DeviceInfo, *, cpu_offload: bool = False, mixed_precision: str = "none"
) -> nn.Module:
    """Shard `model` (on `device.torch_device`, default group initialised) in place; returns it.

    Layers first, root last: the root then holds only what no layer owns (embeddings, final norm,
    LM head, a value head), and each layer's all-gather can be prefetched while the previous computes.
    """
    check_mixed_precision(mixed_precision, device)
    device_type = torch.device(device.torch_device).type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    offload = CPUOffloadPolicy(pin_memory=device.is_accelerator) if cpu_offload else OffloadPolicy()
    policy = mixed_precision_policy(mixed_precision)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
    # The model's own output (logits, values) comes back in float32, so logprobs are not rounded to bf16.
    root_policy = MixedPrecisionPolicy(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=torch.float32 if policy.param_dtype is not None else None,
    )
    fully_shard(model, mesh=mesh, mp_policy=root_policy, offload_policy=offload)
    return model


@torch.no_grad()
def full_state_dict(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every entry of the sharded model's state dict, gathered one at a
    time. Collective: every rank must consume the iterator to the end, in the same order."""
    for name, value in model.state_dict().items():
        yield name, value.full_tensor() if isinstance(value, DTensor) else value


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the sharded gradients by the global norm (over all ranks' shards); returns the norm."""
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
