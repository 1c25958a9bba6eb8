"""A tiny float64 Qwen3-MoE, its batch and its token logprobs: what the expert-parallel tests compare
across ranks and one process (tests/integration/test_expert_parallel_ranks.py on gloo ranks,
tests/unit/runtime/twin/test_twin_expert_parallel.py on the npu twin). Never shipped."""

from __future__ import annotations

import torch

NUM_EXPERTS = 8
ROWS_PER_RANK = 2
SEQ = 12


def moe_model(*, num_attention_heads: int = 2, num_key_value_heads: int = 1):
    """8 experts, top-2, 2 layers, float64, the same weights on every call (seed 0). Context
    parallelism needs heads and KV heads it divides (`cp_moe_model`)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        head_dim=64 // num_attention_heads,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        moe_intermediate_size=32,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        num_hidden_layers=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        experts_implementation="eager",  # the default grouped_mm kernel refuses float64
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.float64)
    with torch.no_grad():  # a router of std 0.5 chooses decisively (no near-ties between experts)
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)
    return model


def cp_moe_model():
    """`moe_model` with 4 heads and 2 KV heads (CP 2 gives each rank 2 and 1), attending with sdpa
    (Ulysses takes sdpa or eager)."""
    model = moe_model(num_attention_heads=4, num_key_value_heads=2)
    model.config._attn_implementation = "sdpa"
    return model


def whole_batch(world_size: int) -> torch.Tensor:
    """ROWS_PER_RANK rows per rank of SEQ random tokens, (B, L)."""
    return torch.randint(0, 64, (ROWS_PER_RANK * world_size, SEQ), generator=torch.Generator().manual_seed(1))


def token_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """Each next token's logprob under `model`, (B, L-1)."""
    logits = model(input_ids=tokens).logits[:, :-1]  # (B, L-1, V)
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def ep_job_config(world_size: int, expert_parallel_size: int, *, device: str = "cpu", context_parallel_size: int = 1):
    """A GRPO job config of `world_size` FSDP ranks (world / cp data-parallel ranks of
    `context_parallel_size`) at `expert_parallel_size` (never trained as a job: the ranks build the
    actor's backend from it; no prompts or rewards are read)."""
    from rldock.config import parse_job_config

    return parse_job_config(
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
            "training": {
                "strategy": "fsdp",
                "data_parallel_size": world_size // context_parallel_size,
                "context_parallel_size": context_parallel_size,
                "expert_parallel_size": expert_parallel_size,
            },
            "resources": {"device": device, "devices_per_node": world_size},
        }
    )


def whole_gradients(backend) -> dict:
    """Every parameter's gradient of an FSDP backend's model whole, by name: FSDP's shards gathered,
    then the expert shards over the EP group (collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    from rldock.runtime.engines.expert_parallel import gather_experts

    grads = (
        (name, p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for name, p in backend.model.named_parameters()
    )
    return dict(gather_experts(grads, backend.experts.sharding))
