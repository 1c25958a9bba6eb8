"""One pipeline stage on the npu twin, run as its own process by test_twin_pipeline_parallel.py:
`python twin_pp_rank.py RANK WORLD_SIZE PORT OUT_DIR`. Joins the group through the product's
init_process_group (npu tensors over the twin's `hccl_twin`, its sends and receives included), cuts a float64
Qwen3 to its stage with the actor's FsdpBackend at PP 2, streams the no-gradient pass's activations through
the stages, runs the update's 4 micro-batches on the 1F1B schedule and saves the logprobs, the stage's
gradients under the whole model's names and the norm over both stages."""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict
from twin_fsdp_tp_rank import qwen3
from twin_ranks import join_group, run_rank_script

from rldock.runtime.engines.policy import response_logprobs
from rldock.runtime.engines.process_group import destroy_process_group
from rldock.runtime.training.accumulation import accumulate
from rldock.runtime.training.fsdp import FsdpBackend
from rldock_e2e.moe_fixture import ep_job_config
from rldock_e2e.scored_batch import scored_batch

PP = 2
KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def weighted_logprobs(model, rows) -> torch.Tensor:
    """A loss linear in the rows' logprobs (one trimmed pass), the twin's and one process's alike."""
    logprobs = response_logprobs(model, *(rows[k] for k in KEYS), micro_batch_size=len(rows), trim=True)
    return (logprobs * rows["weights"]).sum()


def main(rank: int, world_size: int, port: int, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    device = join_group(rank, world_size, port)
    backend = FsdpBackend(
        ep_job_config(world_size, 1, device="npu", pipeline_parallel_size=PP),
        model=qwen3().to(device.torch_device),
        device=device,
        rank=rank,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    stage = backend.pipeline
    assert stage is not None
    batch = TensorDict(scored_batch(1, vocab_size=64), batch_size=[4]).to(device.torch_device)
    with torch.no_grad():
        logprobs = response_logprobs(backend.model, *(batch[k] for k in KEYS), micro_batch_size=4, trim=True)

    def micro_loss(micro):
        loss = weighted_logprobs(backend.model, micro)
        return loss, {"loss": float(loss.detach())}

    stats = accumulate(backend, [batch[i : i + 1] for i in range(4)], micro_loss, max_grad_norm=1e9)
    grads = {
        stage.names.whole(name): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu()
        for name, p in backend.model.named_parameters()
    }
    torch.save(
        {
            "stage": stage.links.index,
            "device": str(logprobs.device),
            "logprobs": logprobs.cpu(),
            "loss": stats["loss"],
            "norm": stats["grad_norm"],
            "grads": grads,
        },
        out / f"rank{rank}.pt",
    )
    destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
