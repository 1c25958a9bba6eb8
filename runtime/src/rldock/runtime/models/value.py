"""The critic's model: the policy's transformer body with a scalar value head instead of the LM
head, so PPO's critic starts from the same weights as the policy (its features already read the
task) and only the head is new.

The head starts at zero, so the first values are 0 and the first GAE advantages are the plain
discounted returns: PPO begins as REINFORCE with a whitened baseline and the critic takes over as
it learns, instead of a random head injecting noise into the first updates.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from rldock.runtime.engines.policy import micro_batch_inputs, plan_micro_batches, scatter_rows
from rldock.runtime.models.loading import load_causal_lm


class ValueModel(nn.Module):
    def __init__(self, body: nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        hidden = self.body(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state  # (B, L, H)
        return self.head(hidden).squeeze(-1).float()  # (B, L)


def load_value_model(policy_dir: str | Path, *, dtype: str, device: torch.device | str) -> ValueModel:
    """The causal LM at `policy_dir` without its LM head, plus a zero value head."""
    lm = load_causal_lm(policy_dir, dtype=dtype, device=device)
    model = ValueModel(lm.base_model, lm.config.hidden_size)
    return model.to(device=device, dtype=lm.dtype)


def response_values(
    model: nn.Module,  # a ValueModel, or the DDP wrapper around one
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    trim: bool = False,
) -> Tensor:
    """V(state before response token t) for every t: (B, SL) float32, 0 where the mask is 0.

    The state before token t ends at input position PL + t - 1, the same position whose logits
    score token t in `response_logprobs`, so values and logprobs line up token for token. With
    `trim` each pass runs on its own longest sequence (engines.policy.plan_micro_batches).
    """
    plans = plan_micro_batches(prompt_mask, response_mask, micro_batch_size=micro_batch_size, trim=trim)
    chunks = []
    for plan in plans:
        inputs, scored = micro_batch_inputs(plan, prompt_ids, prompt_mask, response_ids, response_mask)
        values = model(inputs.input_ids, inputs.attention_mask, inputs.position_ids)  # (b, L)
        values = values[:, scored]  # (b, response_end)
        chunks.append(values * response_mask[plan.rows, : plan.response_end].to(values.dtype))
    return scatter_rows(chunks, plans, response_ids.shape[1])  # (B, SL)
