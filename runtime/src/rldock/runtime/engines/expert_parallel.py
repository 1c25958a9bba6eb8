"""Expert parallelism (`training.expert_parallel_size`): each MoE layer's experts split over an EP
group, tokens dispatched to their experts' rank and combined back with all-to-all.

The EP group is carved out of the dp x cp sequence ranks (torchtitan's and Megatron's choice; the
groups are the training mesh's, resharding/parallel_mesh.py): with ranks r = i * ep + j, the ranks
{i * ep + j for j < ep} are one EP group and hold expert shard j (experts [j * E/ep, (j+1) * E/ep)),
each its own tokens; the ranks that hold the same shard (a fixed j) are its expert-data-parallel
group, of dp x cp / ep ranks. Under context
parallelism (CP innermost, training/context_parallel.py) an EP group may so hold a CP group's ranks:
their tokens are distinct positions of the same rows, and the dispatch neither knows nor minds. The
job layout (rldock.contract.layout) is where these sizes are said.

`ExpertParallelExperts` replaces a Hugging Face experts module (Qwen3-MoE's and Mixtral's in
transformers 5: fused `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I) with `forward(hidden (T, H),
top_k_index (T, k), top_k_weights (T, k))`) by this rank's E/ep experts under the same parameter names,
so the router, the rest of the layer and every state-dict name stay the model's own. Its forward:

1. sort the T*k (token, expert) assignments by expert, so each destination rank's are contiguous;
2. all-to-all the counts, then the expert ids and the tokens' hidden states (differentiable);
3. run each local expert on the tokens it received (the same math as Hugging Face's eager loop);
4. all-to-all the outputs back, weight them by the router's weights and sum into each token.

An expert's gradient is the sum over every EP rank's tokens (the all-to-all's backward brings them);
`grad_scale` multiplies it (1 / the data-parallel size under FSDP, whose loss is a mean over ranks).

Dispatch is dropless (no capacity), as Hugging Face and vLLM route. On CPU the collectives run over
gloo, whose all_to_all_single takes uneven splits and whose autograd form
(torch.distributed._functional_collectives.all_to_all_single_autograd) sends gradients back along
the same routes.

Whole weights in the Hugging Face layout, whatever the EP size: `gather_experts` all-gathers an
expert tensor's shards over the EP group (a checkpoint, the engine's weights), `shard_experts` cuts
this rank's shard from a whole one (loading).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn

from rldock.runtime.resharding.parallel_mesh import ExpertSharding

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def check_experts_divide(num_experts: int, size: int) -> None:
    if num_experts % size:
        raise ValueError(
            f"training.expert_parallel_size {size} must divide the model's {num_experts} experts; "
            f"use a divisor of {num_experts}"
        )


class ExpertParallelExperts(nn.Module):
    """This rank's experts of one MoE layer and the all-to-all dispatch (module docstring)."""

    def __init__(self, experts: nn.Module, sharding: ExpertSharding):
        super().__init__()
        if getattr(experts, "is_transposed", False) or getattr(experts, "has_bias", False):
            raise ValueError(
                f"training.expert_parallel_size: expert parallelism takes Hugging Face's fused, untransposed, "
                f"bias-free experts (Qwen3-MoE, Qwen2-MoE, Mixtral), not {type(experts).__name__}; set "
                "training.expert_parallel_size: 1 for this model"
            )
        gate_up_proj, down_proj = experts.get_parameter("gate_up_proj"), experts.get_parameter("down_proj")
        num_experts = int(gate_up_proj.shape[0])
        check_experts_divide(num_experts, sharding.size)
        local = sharding.local_experts(num_experts)
        self.sharding = sharding
        self.num_experts = num_experts
        self.first_expert = local.start
        self.gate_up_proj = nn.Parameter(gate_up_proj.detach()[local.start : local.stop].clone())  # (E/ep, 2I, H)
        self.down_proj = nn.Parameter(down_proj.detach()[local.start : local.stop].clone())  # (E/ep, H, I)
        self.act_fn = cast(Callable[[Tensor], Tensor], experts.act_fn)
        self.grad_scale = 1.0  # set by the layout that reduces the experts' gradients (engines/fsdp_sharding.py)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        group, size = self.sharding.group, self.sharding.size
        num_tokens, top_k = top_k_index.shape
        num_local = self.gate_up_proj.shape[0]
        experts = top_k_index.reshape(-1)  # (T*k,)
        order = torch.argsort(experts, stable=True)  # (T*k,) assignments grouped by expert, so by rank
        token_of = order // top_k  # (T*k,) the token of each sorted assignment
        sorted_experts = experts[order]
        send_counts = torch.bincount(sorted_experts // num_local, minlength=size)  # (ep,)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        recv_experts = sorted_experts.new_empty(sum(recv))  # (R,) the global expert of each received token
        dist.all_to_all_single(recv_experts, sorted_experts, recv, send, group=group)
        group_name = group if group is not None else dist.distributed_c10d._get_default_group()
        received = funcol.all_to_all_single_autograd(hidden_states[token_of], recv, send, group_name)  # (R, H)
        computed = torch.zeros_like(received)  # (R, H)
        gate_up_proj, down_proj = (
            _scale_grad(self.gate_up_proj, self.grad_scale),
            _scale_grad(self.down_proj, self.grad_scale),
        )
        for local in range(num_local):
            rows = torch.nonzero(recv_experts == self.first_expert + local).squeeze(1)
            if rows.numel() == 0:
                continue
            gate, up = nn.functional.linear(received[rows], gate_up_proj[local]).chunk(2, dim=-1)
            out = nn.functional.linear(self.act_fn(gate) * up, down_proj[local])
            computed = computed.index_add(0, rows, out)
        returned = funcol.all_to_all_single_autograd(computed, send, recv, group_name)  # (T*k, H), sorted order
        weights = top_k_weights.reshape(-1)[order, None].to(returned.dtype)  # (T*k, 1)
        combined = torch.zeros(
            num_tokens, hidden_states.shape[1], dtype=hidden_states.dtype, device=hidden_states.device
        )
        return combined.index_add(0, token_of, (returned * weights).to(hidden_states.dtype))  # (T, H)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _scale_grad(tensor: Tensor, scale: float) -> Tensor:
    return tensor if scale == 1.0 else _ScaleGrad.apply(tensor, scale)


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each MoE layer's fused experts: a sparse block's `experts` beside its router."""
    found = []
    for name, module in model.named_modules():
        if hasattr(module, "gate") and hasattr(module, "experts") and hasattr(module.gate, "top_k"):
            found.append((f"{name}.experts", module.experts))
    return found


def apply_expert_parallel(model: nn.Module, sharding: ExpertSharding) -> list[ExpertParallelExperts]:
    """Replace every MoE layer's experts by this rank's shard in place (collective-free: each rank
    cuts its own experts from the whole weights it loaded); returns the new experts modules."""
    modules = expert_modules(model)
    if not modules:
        raise ValueError(
            "training.expert_parallel_size > 1 needs an MoE model (Qwen3-MoE, Mixtral, DeepSeek-V3); the model has "
            "no experts"
        )
    replaced = []
    for name, experts in modules:
        block = model.get_submodule(name.rsplit(".", 1)[0])
        replaced.append(ExpertParallelExperts(experts, sharding))
        block.experts = replaced[-1]
    return replaced


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the model's expert-parallel experts (each rank's own shard)."""
    return [p for module in model.modules() if isinstance(module, ExpertParallelExperts) for p in module.parameters()]


def is_expert_tensor(name: str) -> bool:
    """Whether a state-dict name is a fused expert tensor, split over EP ranks along dim 0."""
    return name.rsplit(".", 1)[-1] in EXPERT_PARAMS and ".experts." in name


@torch.no_grad()
def all_gather_experts(tensor: Tensor, sharding: ExpertSharding) -> Tensor:
    """The whole (E, ...) tensor from every EP rank's (E/ep, ...) shard. Collective over the EP group."""
    parts = [torch.empty_like(tensor) for _ in range(sharding.size)]
    dist.all_gather(parts, tensor.contiguous(), group=sharding.group)
    return torch.cat(parts)


def local_experts_of(tensor: Tensor, sharding: ExpertSharding) -> Tensor:
    """This rank's (E/ep, ...) rows of a whole (E, ...) expert tensor."""
    local = sharding.local_experts(tensor.shape[0])
    return tensor[local.start : local.stop]


def gather_experts(weights: Iterable[tuple[str, Tensor]], sharding: ExpertSharding) -> Iterator[tuple[str, Tensor]]:
    """The whole model's (name, tensor) from this rank's: each expert tensor all-gathered over the EP
    group along the expert dim, in order. Collective: every EP rank consumes it to the end."""
    for name, tensor in weights:
        yield name, all_gather_experts(tensor, sharding) if sharding.size > 1 and is_expert_tensor(name) else tensor


def shard_experts(weights: dict[str, Tensor], sharding: ExpertSharding) -> dict[str, Tensor]:
    """Whole tensors by state-dict name -> this rank's: expert tensors cut to its experts."""
    return {
        name: local_experts_of(tensor, sharding) if sharding.size > 1 and is_expert_tensor(name) else tensor
        for name, tensor in weights.items()
    }


def gather_expert_state(state: dict, sharding: ExpertSharding) -> dict:
    """An optimizer's full state dict (torch.distributed.checkpoint's, keyed by parameter name) with
    each expert parameter's tensors (AdamW's moments, not its 0-dim step) all-gathered over the EP
    group, so it reads as one process's. Collective over the EP group."""
    return _map_expert_state(state, sharding, all_gather_experts)


def shard_expert_state(state: dict, sharding: ExpertSharding) -> dict:
    """Inverse of `gather_expert_state`: each expert parameter's tensors cut to this rank's experts."""
    return _map_expert_state(state, sharding, local_experts_of)


def _map_expert_state(state: dict, sharding: ExpertSharding, fn: Callable[[Tensor, ExpertSharding], Tensor]) -> dict:
    if sharding.size == 1:
        return state
    per_param = dict(state["state"])
    for name in sorted(per_param):  # the same order on every rank (gathers are collective)
        if is_expert_tensor(name):
            per_param[name] = {
                key: fn(value, sharding) if isinstance(value, Tensor) and value.dim() > 0 else value
                for key, value in sorted(per_param[name].items())
            }
    return {**state, "state": per_param}
