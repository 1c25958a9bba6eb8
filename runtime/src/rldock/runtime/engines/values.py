"""The value model's pass: V(state before response token t) for every response token, micro-batched
and trimmed like the policy's logprobs (engines/policy.py), so values and logprobs line up token for
token. The model itself (rldock.runtime.models.value) is architecture only."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rldock.runtime.engines.packing import pass_work
from rldock.runtime.engines.policy import PassTally, micro_batch_inputs, plan_micro_batches, scatter_rows
from rldock.runtime.engines.ulysses import context_mask, pass_mask, shard_forward
from rldock.runtime.models.context_group import context_group, sum_over_group
from rldock.runtime.models.pipeline_stage import pipeline_links


def valued_tokens(batch) -> Tensor:
    """The response tokens whose values the critic trains (B, SL): `value_mask` where GAE wrote one (its
    steps: the model's tokens, or each turn's first under algorithm.gae_unit turn), else `response_mask`."""
    return batch["value_mask"] if "value_mask" in batch.keys() else batch["response_mask"]


def response_values(
    model: nn.Module,  # a ValueModel, or the DDP wrapper around one
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    trim: bool = False,
    attention_mask: Tensor | None = None,
    tally: PassTally | None = None,
) -> Tensor:
    """V(state before response token t) for every t: (B, SL) float32, 0 where the mask is 0.

    The state before token t ends at input position PL + t - 1, the same position whose logits
    score token t in `response_logprobs`, so values and logprobs line up token for token. With
    `trim` each pass runs on its own longest sequence (engines.policy.plan_micro_batches).
    `attention_mask` (B, SL): the response tokens attended to, when more than the valued ones (a
    multi-turn trajectory's tool tokens, `response_attention`); None: `response_mask`. `tally`
    adds up what the passes computed (the value head's one output per position left out).

    Under context parallelism (engines/ulysses.py) each rank computes its slice of the positions and
    the values are summed over the CP group (each rank's zero where another computed). Under pipeline
    parallelism (models/pipeline_stage.py) every stage runs the same passes through its own layers and only
    the last, which holds the head, has values: the others' are zeros, as a stage's logprobs are
    (engines/policy.py).
    """
    attention = response_mask if attention_mask is None else attention_mask
    plans = plan_micro_batches(prompt_mask, attention, micro_batch_size=micro_batch_size, trim=trim)
    group = context_group(model)
    cp = 1 if group is None else torch.distributed.get_world_size(group)
    stage = pipeline_links(model)
    scores = stage is None or stage.last  # a stage before the last passes its states on (docstring)
    chunks = []
    for plan in plans:
        inputs, scored = micro_batch_inputs(plan, prompt_ids, prompt_mask, response_ids, attention)
        if group is None:
            values = model(inputs.input_ids, inputs.attention_mask, inputs.position_ids)  # (b, L)
            values = values if scores else values.new_zeros(values.shape[:2])
        else:
            kind, dtype = context_mask(model)
            mask = pass_mask(inputs.attention_mask, kind=kind, dtype=dtype)
            local_values, local = shard_forward(
                model, inputs.input_ids, mask, inputs.position_ids, group=group, kind=kind
            )  # (b, n)
            local_values = local_values if scores else local_values.new_zeros(local_values.shape[:2])
            length = (local.stop - local.start) * cp  # the padded sequence N
            values = sum_over_group(nn.functional.pad(local_values, (local.start, length - local.stop)), group)
        if tally is not None:
            rows = plan.rows
            tokens, pairs = pass_work(prompt_ids[rows], prompt_mask[rows], attention[rows], packed=False)
            tally.tokens, tally.pairs = tally.tokens + -(-tokens // cp), tally.pairs + -(-pairs // cp)
        values = values[:, scored]  # (b, response_end)
        chunks.append(values * response_mask[plan.rows, : plan.response_end].to(values.dtype))
    return scatter_rows(chunks, plans, response_ids.shape[1])  # (B, SL)
