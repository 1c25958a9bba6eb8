"""A tiny float64 Qwen3-MoE, its batch and its token logprobs: what the expert-parallel tests compare
across ranks and one process (tests/ranks/test_expert_parallel_ranks.py on gloo ranks,
tests/unit/runtime/twin/test_twin_expert_parallel.py on the npu twin); and its scored passes with the
router's loss and routing replay, what the CP x EP tests compare
(tests/ranks/test_context_expert_parallel_ranks.py, test_twin_context_expert_parallel.py). Never shipped."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from rldock_e2e.scored_batch import LAYOUTS, PROMPT_LENGTH, RESPONSE_LENGTH, scored_batch

NUM_EXPERTS = 8
ROUTER_COEF = 0.5  # large, so the router's loss weighs in the loss and gradients as the logprobs do
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


def ep_job_config(
    world_size: int,
    expert_parallel_size: int,
    *,
    device: str = "cpu",
    context_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
):
    """A GRPO job config of `world_size` FSDP ranks (`pipeline_parallel_size` stages of world / (pp x cp x
    tp) data-parallel ranks of `context_parallel_size` x `tensor_parallel_size`) at `expert_parallel_size`
    (never trained as a job: the ranks build the actor's backend from it; no prompts or rewards are read)."""
    shared = pipeline_parallel_size * context_parallel_size * tensor_parallel_size
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
                "data_parallel_size": world_size // shared,
                "pipeline_parallel_size": pipeline_parallel_size,
                "context_parallel_size": context_parallel_size,
                "tensor_parallel_size": tensor_parallel_size,
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


def cp_batch(seed: int) -> dict[str, torch.Tensor]:
    """`scored_batch` in this model's vocabulary: 4 rows of 6 prompt and 7 response columns."""
    return scored_batch(seed, vocab_size=64)


def random_routing() -> torch.Tensor:
    """A record (B, PL + SL, layers, k) of two distinct experts per token, none the router's choice
    by design: what replay makes every pass use."""
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(4, PROMPT_LENGTH + RESPONSE_LENGTH, 2, NUM_EXPERTS, generator=g)
    return scores.argsort(dim=-1)[..., :2].to(torch.int16)


def scored_with_router_loss(model, batch, layout: str, *, replay: bool) -> dict:
    """On `cp_batch`'s `batch` in `layout` (scored_batch.LAYOUTS), replaying `random_routing` or not: the
    logprobs (4, 7), the loss (linear in the logprobs, plus ROUTER_COEF x the load-balancing loss) and that
    loss's value, after the backward; as the update's policy step records, replays and adds the router term."""
    from rldock.runtime.engines.policy import response_logprobs
    from rldock.runtime.models.router_loss import RouterLoss
    from rldock.runtime.models.routing_replay import pass_listeners, replaying_routes

    router = RouterLoss(model, coef=ROUTER_COEF)
    replaying = replaying_routes(model, random_routing()) if replay else nullcontext()
    with replaying as replayed, router.recording(model) as record:
        logprobs = response_logprobs(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            routes=pass_listeners(replayed, record),
            **LAYOUTS[layout],
        )
    loss, metrics = router.add((logprobs * batch["weights"]).sum(), {}, record, share=1.0)
    loss.backward()
    return dict(logprobs=logprobs.detach(), loss=float(loss.detach()), aux=metrics["moe/aux_loss"])


def recorded_routing(model, batch) -> torch.Tensor:
    """The routing a packed pass over the batch records (B, PL + SL, layers, k): the old logprobs' pass
    under algorithm.routing_replay reference."""
    from rldock.runtime.engines.policy import response_logprobs
    from rldock.runtime.models.routing_replay import recording_routes

    with torch.no_grad(), recording_routes(model, num_rows=4, row_width=PROMPT_LENGTH + RESPONSE_LENGTH) as record:
        args = (batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])
        response_logprobs(model, *args, routes=record, **LAYOUTS["packed"])
    return record.routed_experts()
