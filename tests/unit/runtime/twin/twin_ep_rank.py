"""One expert-parallel rank on the npu twin, run as its own process by test_twin_expert_parallel.py:
`python twin_ep_rank.py RANK WORLD_SIZE PORT OUT_DIR`. Joins the group through the product's
init_process_group (npu tensors over the twin's `hccl_twin`, whose all-to-all stages through gloo),
shards a float64 Qwen3-MoE (8 experts, top-2) on npu:RANK with the actor's FsdpBackend at EP = WORLD,
scores its rows and backpropagates, and saves its logprobs and the whole gradients."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rldock.runtime.device import detect_device
from rldock.runtime.engines.process_group import Rendezvous, destroy_process_group, init_process_group
from rldock.runtime.training.fsdp import FsdpBackend
from rldock_e2e.doubles.npu_twin import activate
from rldock_e2e.moe_fixture import ROWS_PER_RANK, ep_job_config, moe_model, token_logprobs, whole_batch


def main(rank: int, world_size: int, port: int, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    from rldock.runtime.engines.expert_parallel import gather_experts

    activate()
    torch.set_num_threads(1)
    device = detect_device("npu", index=rank)
    # The test process holds the store; every rank (rank 0 too) connects to it as a client.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=120))
    init_process_group(
        device,
        rank=rank,
        world_size=world_size,
        rendezvous=Rendezvous(address="127.0.0.1", port=port),
        store=store,
        timeout_s=120,
    )
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
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    # Leave without interpreter finalization, as twin_ddp_rank.py explains.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
