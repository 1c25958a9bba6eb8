"""One expert-parallel rank on the npu twin, run as its own process by test_twin_expert_parallel.py:
`python twin_ep_rank.py RANK WORLD_SIZE PORT OUT_DIR`. Joins the group through the product's
init_process_group (npu tensors over the twin's `hccl_twin`, whose all-to-all stages through gloo),
shards a float64 Qwen3-MoE (8 experts, top-2) on npu:RANK with the actor's FsdpBackend at EP = WORLD,
scores its rows and backpropagates, and saves its logprobs and the whole gradients."""

from __future__ import annotations

from pathlib import Path

import torch
from twin_ranks import join_group, run_rank_script

from rldock.runtime.engines.process_group import destroy_process_group
from rldock.runtime.training.fsdp import FsdpBackend
from rldock_e2e.moe_fixture import ROWS_PER_RANK, ep_job_config, moe_model, token_logprobs, whole_batch


def main(rank: int, world_size: int, port: int, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    from rldock.runtime.engines.expert_parallel import gather_experts

    device = join_group(rank, world_size, port)
    cfg = ep_job_config(world_size, world_size, device="npu")
    backend = FsdpBackend(
        cfg,
        model=moe_model().to(device.torch_device),
        device=device,
        rank=rank,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    mine = whole_batch(world_size)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK].to(device.torch_device)
    scores = token_logprobs(backend.model, mine)
    (-scores.mean()).backward()
    local = (
        (n, p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for n, p in backend.model.named_parameters()
    )
    grads = {name: grad.cpu() for name, grad in gather_experts(local, backend.experts.sharding)}
    torch.save(
        {"logprobs": scores.detach().cpu(), "grads": grads, "device": str(scores.device)}, out / f"rank{rank}.pt"
    )
    destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
