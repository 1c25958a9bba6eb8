"""The policy's passes over dock batches, with the job's micro-batching: the logprobs an inference
stage writes (the actor's old logprobs, the reference's) and the scores an update's micro-batch
trains on (rldock.runtime.engines.policy does the model's work).

A batch holds `prompt_ids` / `prompt_mask` (B, PL), left-padded, `response_ids` / `response_mask`
(B, SL), right-padded, and for multi-turn episodes `response_attention_mask` (B, SL).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from rldock.config.training import TrainingSpec
from rldock.runtime.engines.policy import (
    PassTally,
    ResponseScores,
    micro_batch_rows,
    packing_prompts,
    response_attention,
    response_logprobs,
    response_logprobs_and_entropy,
)
from rldock.runtime.models.pass_cells import PassListener


def batch_logprobs(
    model: nn.Module,
    batch: TensorDict,
    training: TrainingSpec,
    *,
    tally: PassTally | None = None,
    routes: PassListener | None = None,
) -> torch.Tensor:
    """Each response token's logprob (B, SL) under `model` (the bare model, no DDP hooks), in passes of
    training.micro_batch_size rows within training.micro_batch_tokens, trimmed by training.trim_padding.
    The caller decides on gradients (inference stages run it under torch.no_grad); `tally` adds up
    what the passes computed; `routes` records or replays an MoE's routing (models/routing_replay.py)."""
    return response_logprobs(
        model,
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["response_ids"],
        batch["response_mask"],
        micro_batch_size=training.micro_batch_size,
        max_tokens=training.micro_batch_tokens,
        trim=training.trim_padding,
        attention_mask=response_attention(batch),
        tally=tally,
        routes=routes,
    )  # (B, SL)


def micro_batch_scores(
    module: nn.Module,
    micro: TensorDict,
    training: TrainingSpec,
    *,
    tally: PassTally | None = None,
    routes: PassListener | None = None,
) -> ResponseScores:
    """Logprobs (with gradients) and the policy's entropy of a micro-batch's response tokens, (b, SL)
    each, in one forward pass of `module` (what the training backend trains: a DDP wrapper, or the
    model sharded in place); `tally` adds up what the pass computed; `routes` replays an MoE's routing."""
    return response_logprobs_and_entropy(
        module,
        micro["prompt_ids"],
        micro["prompt_mask"],
        micro["response_ids"],
        micro["response_mask"],
        micro_batch_size=len(micro),
        trim=training.trim_padding,
        attention_mask=response_attention(micro),
        tally=tally,
        routes=routes,
    )


def update_micro_batches(module: nn.Module, mini_batch: TensorDict, training: TrainingSpec) -> list[torch.Tensor]:
    """The rows (b,) of each micro-batch an update accumulates over a mini-batch: training.micro_batch_size
    rows within training.micro_batch_tokens; with training.trim_padding a GRPO group's rows together when
    `module`'s passes pack (each prompt computed once, engines/packing.py), else sorted by length (each
    pass trimmed to its longest row)."""
    attention = response_attention(mini_batch)
    size, budget, trim = training.micro_batch_size, training.micro_batch_tokens, training.trim_padding
    packing = packing_prompts(
        module,
        mini_batch["prompt_ids"],
        mini_batch["prompt_mask"],
        attention,
        trim=trim,
        micro_batch_size=size,
        max_tokens=budget,
    )
    return micro_batch_rows(
        mini_batch["prompt_mask"], attention, micro_batch_size=size, trim=trim, max_tokens=budget, prompt_ids=packing
    )
