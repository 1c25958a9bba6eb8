"""One expert-parallel rank on the npu twin, run as its own process by test_twin_expert_parallel.py:
`python twin_ep_rank.py RANK WORLD_SIZE PORT OUT_DIR`. Joins the group through the product's
init_process_group (npu tensors over the twin's `hccl_twin`, whose all-to-all stages through gloo),
shards a float64 Qwen3-MoE (8 experts, top-2) on npu:RANK with the actor's FsdpBackend at EP = WORLD,
scores its rows and backpropagates, and saves its logprobs and the whole gradients."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from rldock.config import parse_job_config
from rldock.runtime.device import detect_device
from rldock.runtime.engines.distributed import Rendezvous, destroy_process_group, init_process_group
from rldock.runtime.training.fsdp import FsdpBackend
from rldock_e2e.doubles.npu_twin import activate

ROWS_PER_RANK = 2


def moe_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        head_dim=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        experts_implementation="eager",  # the grouped_mm kernel refuses float64
    )
    torch.manual_seed(0)  # the same initial weights on every rank and in the test's single process
    model = Qwen3MoeForCausalLM(config).to(torch.float64)
    with torch.no_grad():  # HF initialises the router at zero (every tie); a random router routes for real
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
    return model


def whole_batch(world_size: int) -> torch.Tensor:
    return torch.randint(0, 64, (ROWS_PER_RANK * world_size, 12), generator=torch.Generator().manual_seed(1))  # (B, L)


def logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens).logits[:, :-1]  # (B, L-1, V)
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, L-1)


def main(rank: int, world_size: int, port: int, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    from rldock.runtime.engines.expert_parallel import gather_experts

    activate()
    torch.set_num_threads(1)
    device = detect_device("npu", index=rank)
    init_process_group(
        device, rank=rank, world_size=world_size, rendezvous=Rendezvous(address="127.0.0.1", port=port), timeout_s=120
    )
    cfg = parse_job_config(
        {
            "iterations": 1,
            "model": {"path": "unused"},
            "data": {"generator": {"name": "addition"}},
            "reward": {"terms": [{"name": "digit_match"}]},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": world_size,
                "num_responses_per_prompt": 2,
                "max_prompt_length": 8,
                "max_response_length": 8,
                "learning_rate": 0.1,
            },
            "training": {"strategy": "fsdp", "data_parallel_size": world_size, "expert_parallel_size": world_size},
            "resources": {"device": "npu", "devices_per_node": world_size},
        }
    )
    backend = FsdpBackend(
        cfg,
        model=moe_model().to(device.torch_device),
        device=device,
        rank=rank,
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    mine = whole_batch(world_size)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK].to(device.torch_device)
    scores = logprobs(backend.model, mine)
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
