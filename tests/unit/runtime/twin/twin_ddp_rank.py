"""One data-parallel rank on the npu twin, run as its own process by test_twin_ddp.py:
`python twin_ddp_rank.py RANK WORLD_SIZE PORT OUT_DIR`. Joins the group through the product's
init_process_group (the device seam's backend), wraps a model with wrap_ddp on npu:RANK, takes one
backward step on its own input, and saves the averaged gradient and its own local one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rldock.runtime.device import detect_device
from rldock.runtime.engines.process_group import Rendezvous, destroy_process_group, init_process_group, wrap_ddp
from rldock_e2e.doubles.npu_twin import activate


def main(rank: int, world_size: int, port: int, out: Path) -> None:
    activate()
    device = detect_device("npu", index=rank)
    init_process_group(
        device, rank=rank, world_size=world_size, rendezvous=Rendezvous(address="127.0.0.1", port=port), timeout_s=120
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device.torch_device)
    ddp = wrap_ddp(model, device)
    torch.manual_seed(100 + rank)  # each rank its own data
    batch = torch.randn(4, 8).to(device.torch_device)
    ddp(batch).square().mean().backward()
    averaged = {name: p.grad.cpu() for name, p in model.named_parameters()}
    model.zero_grad()
    model(batch).square().mean().backward()  # the bare module: this rank's own gradient
    local = {name: p.grad.cpu() for name, p in model.named_parameters()}
    tokens = torch.tensor([float(rank + 1)])  # a host tensor: gloo, as the actor's token count
    dist.all_reduce(tokens)
    torch.save(
        {
            "averaged": averaged,
            "local": local,
            "tokens": tokens,
            "grad_device": str(next(model.parameters()).grad.device),
        },
        out / f"rank{rank}.pt",
    )
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    # Leave without interpreter finalization: gloo's run-loop thread may still hold the last
    # collective's tensor, and releasing it needs the GIL; a thread that asks for the GIL once
    # finalization has begun is ended mid-destructor and std::terminate aborts the rank (about one
    # run in seven on 2 cores). The results are on disk; an exception above still exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
