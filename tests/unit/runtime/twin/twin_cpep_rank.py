"""One rank of context parallelism composed with expert parallelism on the npu twin, run as its own
process by test_twin_context_expert_parallel.py: `python twin_cpep_rank.py RANK WORLD_SIZE PORT OUT_DIR`.
Joins the group through the product's init_process_group (npu tensors over the twin's `hccl_twin`),
shards the float64 Qwen3-MoE of the CP x EP rank tests on npu:RANK with the actor's FsdpBackend at
CP = EP = WORLD (one data-parallel rank: the EP group is the CP group), scores the batch packed
with routing replay and padded without, with the router's loss, and saves the logprobs, losses and whole
gradients."""

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
from rldock_e2e.moe_fixture import cp_batch, cp_moe_model, ep_job_config, scored_with_router_loss, whole_gradients

# (layout, routing replay): both layouts and both replay modes, in two cases (the gloo rank test runs all four)
CASES = [("packed", True), ("padded", False)]


def main(rank: int, world_size: int, port: int, out: Path) -> None:
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
    backend = FsdpBackend(
        ep_job_config(world_size, world_size, device="npu", context_parallel_size=world_size),
        model=cp_moe_model().to(device.torch_device),
        device=device,
        rank=rank,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    batch = {name: tensor.to(device.torch_device) for name, tensor in cp_batch(10).items()}
    cases: dict = {}
    for layout, replay in CASES:
        backend.model.zero_grad()
        scored = scored_with_router_loss(backend.model, batch, layout, replay=replay)
        grads = {name: grad.cpu() for name, grad in whole_gradients(backend).items()}
        cases[layout, replay] = scored | {"logprobs": scored["logprobs"].cpu(), "grads": grads}
    device = str(next(backend.model.parameters()).device)
    torch.save({"cases": cases, "device": device}, out / f"rank{rank}.pt")
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    # Leave without interpreter finalization, as twin_ddp_rank.py explains.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
