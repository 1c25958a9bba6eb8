"""Apply the training layout to a plain Hugging Face Llama, Qwen2, Qwen3, Qwen3-MoE or DeepSeek-V3 model (its
attention; its experts are expert parallelism's) from outside: a
tensor-parallel plan (DTensor; the architecture's `TP_PLANS` entry) on the training mesh's `tp` dimension
(parallel_mesh.py), and gradient averaging over its `dp`.

In the TP layout (`strategy: ddp`), data parallelism is plain gradient averaging over the DP group after
backward (what DDP does, without its bucketed overlap): DDP over DTensor parameters needs torch's private
2-D hooks. `strategy: fsdp` shards the TP shards again along DP instead (training/fsdp.py, FSDP x TP),
and its engine push gathers them whole. These architectures' attention reshapes with -1 heads, so it runs on the
local heads unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rldock.contract.tensor_parallel import TP_PLANS, check_architecture, check_divisible
from rldock.runtime.models.layers import decoder_layers
from rldock.runtime.resharding.parallel_layout import has_partial_gradient
from rldock.runtime.resharding.parallel_mesh import ParallelMesh

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def parallelize_decoder(model: nn.Module, mesh: ParallelMesh) -> nn.Module:
    """Split every decoder layer's linears over the mesh's `tp` dimension, in place; returns `model`.

    With a TP size of 1 the model is left as plain tensors (a DTensor over one rank buys nothing).
    """
    tp_size = mesh.size("tp")
    if tp_size == 1:
        return model
    config: Any = model.config  # the architecture's Hugging Face config
    check_architecture(tp_size=tp_size, model_type=config.model_type, field="training.tensor_parallel_size")
    tp_plan = TP_PLANS[config.model_type]
    check_divisible(
        tp_size=tp_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        intermediate_size=config.intermediate_size if tp_plan.splits_mlp else None,
        field="training.tensor_parallel_size",
    )
    layers = range(len(decoder_layers(model)))  # a pipeline stage's own layers (training/pipeline.py)
    modules = dict(model.named_modules())
    plan = {}
    for i in layers:
        for suffix, style in tp_plan.linears.items():
            name = f"model.layers.{i}.{suffix}"
            if name in modules:
                plan[name] = _STYLES[style]()
            elif suffix not in tp_plan.optional_linears:  # a plan that no longer names the model's modules
                raise ValueError(f"the {config.model_type} TP plan splits {suffix}, which layer {i} lacks")
    group = mesh.group("tp")
    for suffix, field in tp_plan.partial_output_tails:
        hook = _tail_gradient_summed(int(getattr(config, field)), group)
        for i in layers:
            module = modules[f"model.layers.{i}.{suffix}"]
            if not getattr(module, "_rldock_tail_summed", False):  # once, whoever parallelizes the model again
                module.register_forward_hook(hook)
                module._rldock_tail_summed = True
    return parallelize_module(model, mesh.device_mesh("tp"), plan)


def _tail_gradient_summed(width: int, group):
    """A forward hook: the module's output, its last `width` features' gradient summed over `group`. The module
    is replicated, so its output is a plain tensor."""

    def hook(_module, _args, out):
        assert not isinstance(out, DTensor), "partial_output_tails names a replicated module, not a split one"
        return _SumTailGradient.apply(out, width, group)

    return hook


class _SumTailGradient(torch.autograd.Function):
    """The identity forward; backward, the gradient of the last `width` features summed over the TP group: the
    outputs of a replicated module that each rank's heads read directly (TpPlan.partial_output_tails), whose
    gradient is then the rank's heads' part only; the rest reaches split linears, which sum their own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        tail = grad[..., -ctx.width :].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.width :] = tail
        return grad, None, None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (an alias, sharing storage), or `tensor` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def sum_partial_gradients(model: nn.Module, mesh: ParallelMesh) -> None:
    """Sum over the `tp` group the gradients of replicated per-head modules (`has_partial_gradient`),
    in place, so every TP rank holds the whole model's gradient for them (after backward)."""
    tp = mesh.group("tp")
    if tp is None:
        return
    config: Any = model.config
    plan = TP_PLANS[config.model_type]  # parallelize_decoder checked that it has one
    for name, param in model.named_parameters():
        if param.grad is not None and has_partial_gradient(name, plan):
            dist.all_reduce(local_tensor(param.grad), group=tp)


@torch.no_grad()
def average_gradients(model: nn.Module, mesh: ParallelMesh) -> None:
    """Average each parameter's gradient over the `dp` dimension, in place (after backward)."""
    group = mesh.group("dp")
    if group is None:
        return
    for param in model.parameters():
        if param.grad is not None:
            grad = local_tensor(param.grad)
            dist.all_reduce(grad, group=group)
            grad.div_(mesh.size("dp"))


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, mesh: ParallelMesh) -> float:
    """`torch.nn.utils.clip_grad_norm_` for a model mixing TP-sharded and replicated parameters
    (torch's own refuses the mix): split gradients add their squares over the `tp` group,
    replicated ones count once. Returns the total norm before clipping."""
    local = [(param.grad, local_tensor(param.grad)) for param in model.parameters() if param.grad is not None]
    sharded = torch.zeros((), dtype=torch.float32, device=local[0][1].device)
    replicated = torch.zeros_like(sharded)
    for grad, shard in local:
        is_split = isinstance(grad, DTensor) and any(p.is_shard() for p in grad.placements)
        square = shard.float().pow(2).sum()
        if is_split:
            sharded += square
        else:
            replicated += square
    if (tp := mesh.group("tp")) is not None:
        dist.all_reduce(sharded, group=tp)
    total = (sharded + replicated).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # the epsilon and clamp torch uses
    for _, shard in local:
        shard.mul_(scale.to(shard.dtype))
    return float(total)


def apply_gradients(
    model: nn.Module, optimizer: torch.optim.Optimizer, mesh: ParallelMesh, *, max_grad_norm: float
) -> float:
    """After backward: complete per-head gradients over TP, average over DP, clip over the whole
    (TP-split) model, step. Returns the norm."""
    sum_partial_gradients(model, mesh)
    average_gradients(model, mesh)
    norm = clip_grad_norm(model, max_grad_norm, mesh)
    optimizer.step()
    return norm
