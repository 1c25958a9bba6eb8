"""Token logprobs (and entropy) straight from a causal LM's last hidden states, the LM head applied a
chunk of positions at a time: the float32 logits (n, V) of all scored tokens never exist at once.

A pass that scores n tokens of a vocabulary of V otherwise holds (n, V) float32 logits, their
log-softmax and, in the backward, their gradient: for SmolLM2 (V = 49,152) 197 KB per token each,
more than a decoder layer's activations. Here the forward keeps only each token's logsumexp, and
the backward recomputes one chunk's logits to form its gradient (the way Liger's fused linear
cross-entropy and verl's chunked entropy bound the same peak). The numbers are today's definition:
`logits = head(hidden).float() / temperature`, logprob = logit[target] - logsumexp(logits), entropy
= logsumexp - sum_v softmax_v * logit_v; gradients flow into the hidden states and, when it trains,
the head's weight (and bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Float32 logits per chunk: the forward holds about two chunks of these, the backward three.
CHUNK_BYTES = 32 << 20


def chunk_positions(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk whose (chunk, V) float32 logits fit in `chunk_bytes` (at least 1)."""
    return max(1, chunk_bytes // (4 * vocab_size))


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    logits = F.linear(hidden, weight, bias)  # (c, V): the head in the model's dtype, as the model runs it
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 (float64 stays)
    return logits / temperature if temperature != 1.0 else logits


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        num_tokens, dtype = hidden.shape[0], torch.promote_types(hidden.dtype, torch.float32)
        logprobs = hidden.new_empty(num_tokens, dtype=dtype)  # (n,)
        logsumexp = hidden.new_empty(num_tokens, dtype=dtype)  # (n,)
        entropy = hidden.new_empty(num_tokens if with_entropy else 0, dtype=dtype)  # (n,) or (0,)
        for start in range(0, num_tokens, chunk):
            end = min(start + chunk, num_tokens)
            logits = _chunk_logits(hidden[start:end], weight, bias, temperature)  # (c, V)
            lse = logits.logsumexp(dim=-1)  # (c,)
            logsumexp[start:end] = lse
            logprobs[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - lse
            if with_entropy:  # H = lse - sum_v p_v * logit_v
                probs = (logits - lse[:, None]).exp_()  # (c, V), in place of nothing else
                entropy[start:end] = lse - (probs * logits).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, logsumexp)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)  # a metric: no entropy bonus trains on it
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, bias, targets, logsumexp = ctx.saved_tensors
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        # Summed over chunks in float32, cast to the weight's dtype once.
        dtype = logsumexp.dtype
        grad_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if wants_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if wants_bias else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            logits = _chunk_logits(hidden[start:end], weight, bias, ctx.temperature)  # (c, V)
            grad = grad_logprobs[start:end, None].to(logits.dtype)  # (c, 1)
            # d logprob / d logit_v = 1[v = target] - p_v; through the temperature, / T.
            grad_logits = (logits - logsumexp[start:end, None]).exp_().mul_(-grad)  # (c, V)
            grad_logits.scatter_add_(-1, targets[start:end, None], grad)
            if ctx.temperature != 1.0:
                grad_logits /= ctx.temperature
            grad_logits = grad_logits.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad_logits @ weight  # (c, H)
            if grad_weight is not None:
                grad_weight += (grad_logits.T @ hidden[start:end]).to(dtype)  # (V, H)
            if grad_bias is not None:
                grad_bias += grad_logits.sum(dim=0).to(dtype)
        return (
            grad_hidden,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_bias is None else grad_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprob (n,) of each `targets` token (n,) under logits `hidden` (n, H) @ `weight` (V, H).T
    (+ `bias` (V,)) / `temperature`, float32 (float64 for float64 inputs), and the softmax's entropy
    (n,) when `with_entropy` (no gradient), `chunk` positions at a time (default: `chunk_positions`)."""
    if chunk is None:
        chunk = chunk_positions(weight.shape[0])
    logprobs, entropy = _HeadLogprobs.apply(hidden, weight, bias, targets, temperature, chunk, with_entropy)
    return logprobs, entropy if with_entropy else None
