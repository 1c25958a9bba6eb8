"""Torch-side policy math: per-token logprobs (and entropy) of sampled responses under a causal LM.

These build the model inputs from the dock's columns exactly as docs/architecture.md fixes them,
so the actor (old logprobs, training), the reference and any test compute the same numbers:
`input_ids = cat(prompt_ids, response_ids)`, `attention_mask = cat(prompt_mask, response_mask)`,
`position_ids = cumsum(mask) - 1` clamped at 0, and response token t is scored by the logits at
position PL + t - 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class PolicyInputs:
    input_ids: Tensor  # (B, PL+SL) int64
    attention_mask: Tensor  # (B, PL+SL) int64
    position_ids: Tensor  # (B, PL+SL) int64


@dataclass(frozen=True)
class ResponseScores:
    logprobs: Tensor  # (B, SL) float32, 0 where response_mask is 0
    entropy: Tensor  # (B, SL) float32, 0 where response_mask is 0


def build_policy_inputs(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> PolicyInputs:
    """Concatenate left-padded prompts (B, PL) and right-padded responses (B, SL)."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, PL+SL)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # (B, PL+SL)
    # Left pads get position 0 (clamped) and are masked out; real tokens count from 0 as they did
    # in vLLM, which saw the prompt without its pads.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, PL+SL)
    return PolicyInputs(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def _response_logits(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    temperature: float,
) -> Iterator[tuple[Tensor, slice]]:
    """Yield float32 logits (b, SL, V) that score each response token, per micro-batch."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    prompt_len = prompt_ids.shape[1]
    response_len = response_ids.shape[1]
    for start in range(0, prompt_ids.shape[0], micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        inputs = build_policy_inputs(
            prompt_ids[rows], prompt_mask[rows], response_ids[rows], response_mask[rows]
        )
        logits = model(
            input_ids=inputs.input_ids,
            attention_mask=inputs.attention_mask,
            position_ids=inputs.position_ids,
            use_cache=False,
        ).logits  # (b, PL+SL, V)
        # Position PL+t-1 predicts response token t.
        logits = logits[:, prompt_len - 1 : prompt_len + response_len - 1].float()  # (b, SL, V)
        if temperature != 1.0:
            logits = logits / temperature
        yield logits, rows


def response_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
) -> Tensor:
    """Log-probability (B, SL) of each response token under `model`; 0 where the mask is 0.

    Runs `micro_batch_size` rows per forward pass. Gradients flow when called outside
    `torch.no_grad()`, so the same function serves old logprobs, reference logprobs and the loss.
    """
    chunks = []
    for logits, rows in _response_logits(
        model, prompt_ids, prompt_mask, response_ids, response_mask,
        micro_batch_size=micro_batch_size, temperature=temperature,
    ):
        chunks.append(_token_logprobs(logits, response_ids[rows], response_mask[rows]))
    return torch.cat(chunks, dim=0)  # (B, SL)


def response_logprobs_and_entropy(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
) -> ResponseScores:
    """`response_logprobs` plus the policy's entropy (B, SL) at each response position, from the
    same forward pass. Gradients flow into the logprobs only: the entropy is a metric here (no
    entropy bonus), so it is computed without building a second (b, SL, V) autograd graph."""
    logprob_chunks, entropy_chunks = [], []
    for logits, rows in _response_logits(
        model, prompt_ids, prompt_mask, response_ids, response_mask,
        micro_batch_size=micro_batch_size, temperature=temperature,
    ):
        mask = response_mask[rows]
        logprob_chunks.append(_token_logprobs(logits, response_ids[rows], mask))
        with torch.no_grad():
            entropy_chunks.append(token_entropy(logits.detach()) * mask)  # (b, SL)
    return ResponseScores(logprobs=torch.cat(logprob_chunks), entropy=torch.cat(entropy_chunks))


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy H = -sum_v p_v log p_v of the softmax over the last dim: logits (..., V) -> (...).

    A uniform distribution over V tokens gives log V; a (near) one-hot one gives 0.
    """
    log_p = logits.float().log_softmax(dim=-1)  # (..., V)
    return -(log_p.exp() * log_p).sum(dim=-1)  # (...)


def _token_logprobs(logits: Tensor, token_ids: Tensor, mask: Tensor) -> Tensor:
    """logits (b, SL, V) float32, token_ids (b, SL), mask (b, SL) -> (b, SL) masked logprobs."""
    # logit - logsumexp avoids materialising a second (b, SL, V) tensor of log-softmax values.
    picked = logits.gather(dim=-1, index=token_ids.unsqueeze(-1)).squeeze(-1)  # (b, SL)
    logprobs = picked - logits.logsumexp(dim=-1)  # (b, SL)
    # where, not multiply: a pad id's logprob could be -inf, and -inf * 0 is nan.
    return torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs))
