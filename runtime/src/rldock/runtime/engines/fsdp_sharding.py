"""FSDP2 for a trained model (`training.strategy: fsdp`): each decoder layer and then the root are
`fully_shard`ed over the training mesh's sequence ranks (dp x cp, resharding/parallel_mesh.py; all ranks of
the group at TP 1), so every rank holds 1/world of the parameters,
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

With expert parallelism (`expert_parallel_size` > 1, engines/expert_parallel.py) each MoE layer's
experts are first cut to this rank's EP shard, then `fully_shard`ed over their expert-data-parallel
group (the ranks holding the same shard) while the rest of the layer is sharded over all ranks. An
expert's gradient arrives summed over the EP group's tokens (the all-to-all's backward); scaled by
1 / world and summed over the expert-data-parallel group it is the mean over all ranks, as every
other parameter's (averaged by FSDP over all ranks) is. Under context parallelism the ranks are
dp x cp and a step's gradient is the sum over each CP group, the mean over the dp groups: the
experts scale by 1 / dp instead (the EP groups may span CP ranks: rldock.contract.layout).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from rldock.runtime.device import DeviceInfo
from rldock.runtime.engines.expert_parallel import apply_expert_parallel, expert_parameters
from rldock.runtime.models.layers import decoder_layers
from rldock.runtime.resharding.parallel_mesh import ExpertMesh, ParallelMesh

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
    model: nn.Module,
    device: DeviceInfo,
    mesh: ParallelMesh,
    *,
    cpu_offload: bool = False,
    mixed_precision: str = "none",
) -> nn.Module:
    """Shard `model` (on `device.torch_device`) over `mesh`'s sequence ranks (dp x cp) in place; returns it.
    With expert parallelism in `mesh`, its MoE layers' experts are cut to this rank's EP shard first. The
    CP ranks' gradients of one data-parallel rank's rows are summed, not averaged
    (training/context_parallel.py): the experts scale theirs by 1 / dp.

    Experts first (module docstring), then layers, root last: the root then holds only what no layer
    owns (embeddings, final norm, LM head, a value head), and each layer's all-gather can be
    prefetched while the previous computes.
    """
    check_mixed_precision(mixed_precision, device)
    offload = CPUOffloadPolicy(pin_memory=device.is_accelerator) if cpu_offload else OffloadPolicy()
    policy = mixed_precision_policy(mixed_precision)
    experts = mesh.experts
    if experts is not None:
        for module in apply_expert_parallel(model, experts.sharding):
            module.grad_scale = 1 / mesh.size("dp")
            sharded = fully_shard(module, mesh=experts.data_parallel, mp_policy=policy, offload_policy=offload)
            # The module scales its gradients by 1 / world itself (module docstring), so FSDP sums them:
            # a divide factor of 1, reduced as a plain sum (gloo has no pre-multiplied sum). FSDP's own
            # factor is not used because on a group of one (dp = ep) torch 2.13 applies it twice.
            sharded.set_gradient_divide_factor(1.0)
            sharded.set_force_sum_reduction_for_comms(True)
    sequence_ranks = mesh.fsdp  # the dp x cp ranks, or HSDP's (replicas, shards) of them
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=sequence_ranks, mp_policy=policy, offload_policy=offload)
    # The model's own output (logits, values) comes back in float32, so logprobs are not rounded to bf16.
    root_policy = MixedPrecisionPolicy(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=torch.float32 if policy.param_dtype is not None else None,
    )
    fully_shard(model, mesh=sequence_ranks, mp_policy=root_policy, offload_policy=offload)
    return model


@torch.no_grad()
def full_state_dict(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every entry of the sharded model's state dict, gathered one at a
    time. Collective: every rank must consume the iterator to the end, in the same order."""
    for name, value in model.state_dict().items():
        yield name, value.full_tensor() if isinstance(value, DTensor) else value


def clip_grad_norm(
    model: nn.Module,
    max_norm: float,
    *,
    experts: ExpertMesh | None = None,
    stages: dist.ProcessGroup | None = None,
    counted_elsewhere: frozenset[int] | set[int] = frozenset(),
) -> float:
    """Clip the sharded gradients by the global norm (over all ranks' shards); returns the norm.
    `stages`: the pipeline group, whose ranks hold the other stages' layers: their squares add up;
    `counted_elsewhere`: parameters (ids) clipped here but counted by another stage (a tied copy).

    The gradients live on more than one mesh when the layout composes: under TP the split layers' on the
    (sequence ranks, tp) mesh, the rest on the sequence ranks; under expert parallelism the experts' on
    their expert-data-parallel mesh, differing across the EP group. Each part's squared norm is taken on
    its own mesh (a DTensor's norm reduces over all its mesh's dimensions: a TP shard counts once, a
    gradient replicated over TP once), the experts' summed over the EP group, and every part scaled by
    the one total. torch's own refuses a mix of meshes."""
    params = [p for p in model.parameters() if p.grad is not None]
    has_experts = experts is not None and experts.sharding.size > 1
    expert_ids = {id(p) for p in expert_parameters(model)} if has_experts else set()
    by_mesh: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for param in params:
        if id(param) not in expert_ids:
            grad = param.grad
            by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(param)
    if len(by_mesh) <= 1 and not has_experts and stages is None:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    parts = list(by_mesh.values())
    squares = [_squared_norm([p for p in part if id(p) not in counted_elsewhere]) for part in parts]
    if has_experts:  # every rank of the EP group joins the sum, whether it holds expert gradients or not
        assert experts is not None
        parts.append([p for p in params if id(p) in expert_ids])
        squares.append(_squared_norm(parts[-1]))
        dist.all_reduce(squares[-1], group=experts.sharding.group)
    total = torch.stack([square.cpu() for square in squares]).sum()
    if stages is not None:  # on the device: HCCL and NCCL reduce no host tensor
        on_device = total.to(params[0].grad.device if params and params[0].grad is not None else "cpu")
        dist.all_reduce(on_device, group=stages)
        total = on_device.cpu()
    total = total.sqrt()
    for part in parts:
        torch.nn.utils.clip_grads_with_norm_(part, max_norm, total.float())
    return float(total)


def _squared_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The squared norm of `params`' gradients, whole over the mesh they are sharded on (float64)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).double() ** 2
