"""One rank of context parallelism composed with expert parallelism on the npu twin, run as its own
process by test_twin_context_expert_parallel.py: `python twin_cpep_rank.py RANK WORLD_SIZE PORT OUT_DIR`.
Joins the group through the product's init_process_group (npu tensors over the twin's `hccl_twin`),
shards the float64 Qwen3-MoE of the CP x EP rank tests on npu:RANK with the actor's FsdpBackend at
CP = EP = WORLD (one data-parallel rank: the EP group is the CP group), scores the batch packed
with routing replay and padded without, with the router's loss, and saves the logprobs, losses and whole
gradients."""

from __future__ import annotations

from pathlib import Path

import torch
from twin_ranks import join_group, run_rank_script

from rldock.runtime.engines.process_group import destroy_process_group
from rldock.runtime.training.fsdp import FsdpBackend
from rldock_e2e.moe_fixture import cp_batch, cp_moe_model, ep_job_config, scored_with_router_loss, whole_gradients

# (layout, routing replay): both layouts and both replay modes, in two cases (the gloo rank test runs all four)
CASES = [("packed", True), ("padded", False)]


def main(rank: int, world_size: int, port: int, out: Path) -> None:
    device = join_group(rank, world_size, port)
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
    run_rank_script(main)
