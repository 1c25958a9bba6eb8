"""One FSDP rank on the npu twin, run as its own process by test_twin_fsdp.py:
`python twin_fsdp_rank.py RANK WORLD_SIZE PORT OUT_DIR`. Joins the group through the product's
init_process_group (the device seam's backend), shards a tiny Llama on npu:RANK with the actor's
FsdpBackend, takes one step on its half of the batch, pushes the gathered weights to a recording
engine and swaps the training state out, measuring the twin's allocator for this device before and
during generation, then swaps back in and runs the model again."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from rldock.config import parse_job_config
from rldock.runtime.device import detect_device
from rldock.runtime.engines.process_group import Rendezvous, destroy_process_group, init_process_group
from rldock.runtime.training.fsdp import FsdpBackend
from rldock_e2e.doubles.npu_twin import activate

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)
ROWS_PER_RANK = 2


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same initial weights on every rank and in the test's single process
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def whole_batch(world_size: int) -> torch.Tensor:
    return torch.randint(
        0, TINY["vocab_size"], (ROWS_PER_RANK * world_size, 16), generator=torch.Generator().manual_seed(1)
    )  # (B, T)


def _cfg(world_size: int):
    return parse_job_config(
        {
            "iterations": 1,
            "model": {"path": "unused"},
            "checkpoint": {"interval": 1},
            # Never trained as a job: no prompts or rewards are read, but a model of one's own must name them.
            "data": {"generator": {"name": "addition"}},
            "reward": {"terms": [{"name": "digit_match"}]},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": 2,
                "num_responses_per_prompt": 2,
                "max_prompt_length": 8,
                "max_response_length": 8,
                "learning_rate": 1e-2,
            },
            "training": {"strategy": "fsdp", "data_parallel_size": world_size, "resharding": "allgather_swap"},
            "resources": {"device": "npu", "devices_per_node": world_size},
        }
    )


def main(rank: int, world_size: int, port: int, out: Path) -> None:
    activate()
    torch.set_num_threads(1)
    device = detect_device("npu", index=rank)
    init_process_group(
        device, rank=rank, world_size=world_size, rendezvous=Rendezvous(address="127.0.0.1", port=port), timeout_s=120
    )
    model = tiny_model().to(device.torch_device)
    fsdp = FsdpBackend(
        _cfg(world_size),
        model=model,
        device=device,
        rank=rank,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
    )
    # This rank's rows, kept on the host and moved per pass, so the device holds only the model's state.
    mine = whole_batch(world_size)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    batch = mine.to(device.torch_device)
    fsdp.model(input_ids=batch, labels=batch).loss.backward()
    del batch
    grad_norm = fsdp.clip_gradients(1e9)
    fsdp.optimizer.step()
    param_device = str(next(fsdp.model.parameters()).to_local().device)
    buffer_bytes = sum(b.untyped_storage().nbytes() for b in fsdp.model.buffers())  # rotary tables: not training state
    after_update = torch.npu.memory_allocated(device.torch_device)
    pushed: dict[str, torch.Tensor] = {}
    pushed_devices: set[str] = set()

    def update_weights(named_tensors) -> float:  # the engine's update_weights, recorded
        for name, tensor in named_tensors:
            pushed_devices.add(str(tensor.device))
            pushed[name] = tensor.detach().cpu()
        return 0.0

    fsdp.to_generation(update_weights)
    during_generation = torch.npu.memory_allocated(device.torch_device)
    fsdp.to_training()
    after_swap_in = torch.npu.memory_allocated(device.torch_device)
    with torch.no_grad():
        batch = mine.to(device.torch_device)
        loss = float(fsdp.model(input_ids=batch, labels=batch).loss)
    torch.save(
        {
            "weights": pushed,
            "pushed_devices": sorted(pushed_devices),
            "grad_norm": grad_norm,
            "param_device": param_device,
            "loss": loss,
            "buffer_bytes": buffer_bytes,
            "after_update": after_update,
            "during_generation": during_generation,
            "after_swap_in": after_swap_in,
            "ledger": fsdp.drain_metrics()["ledger"],
        },
        out / f"rank{rank}.pt",
    )
    destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    # Leave without interpreter finalization, as twin_ddp_rank.py explains (gloo's run-loop thread
    # releasing the last collective's tensor after finalization began aborts the rank).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
