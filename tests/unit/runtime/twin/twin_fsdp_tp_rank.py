"""One FSDP x TP rank on the npu twin, run as its own process by test_twin_fsdp_tensor_parallel.py:
`python twin_fsdp_tp_rank.py RANK WORLD_SIZE PORT OUT_DIR`. Joins the group through the product's
init_process_group (npu tensors over the twin's `hccl_twin`), lays a float64 Qwen3 out with the actor's
FsdpBackend at TP 2 (its decoder linears split over the TP pair, FSDP over the data-parallel ranks: 2-D
DTensors on npu:RANK), backpropagates its data-parallel rank's rows and saves the logprobs, the whole
gradients after the per-head sums and the gradient norm."""

from __future__ import annotations

from pathlib import Path

import torch
from twin_ranks import join_group, run_rank_script

from rldock.runtime.engines.process_group import destroy_process_group
from rldock.runtime.training.fsdp import FsdpBackend
from rldock_e2e.moe_fixture import ROWS_PER_RANK, ep_job_config, token_logprobs, whole_batch

TP = 2


def qwen3():
    """A float64 Qwen3 of 4 heads and 2 KV heads (TP 2 splits both), the same weights in every process."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config).to(torch.float64).eval()


def main(rank: int, world_size: int, port: int, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    device = join_group(rank, world_size, port)
    backend = FsdpBackend(
        ep_job_config(world_size, 1, device="npu", tensor_parallel_size=TP),
        model=qwen3().to(device.torch_device),
        device=device,
        rank=rank,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    d = backend.context.dp_rank  # the TP pair of data-parallel rank d shares its rows
    mine = whole_batch(world_size // TP)[d * ROWS_PER_RANK : (d + 1) * ROWS_PER_RANK].to(device.torch_device)
    scores = token_logprobs(backend.model, mine)
    (-scores.mean()).backward()
    norm = backend.clip_gradients(1e9)
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).cpu()
        for name, p in backend.model.named_parameters()
    }
    placements = {name: len(p.placements) for name, p in backend.model.named_parameters() if isinstance(p, DTensor)}
    torch.save(
        {
            "dp_rank": d,
            "logprobs": scores.detach().cpu(),
            "grads": grads,
            "norm": norm,
            "placements": placements,
            "device": str(scores.device),
        },
        out / f"rank{rank}.pt",
    )
    destroy_process_group()


if __name__ == "__main__":
    run_rank_script(main)
