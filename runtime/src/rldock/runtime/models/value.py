"""The critic's model: the policy's transformer body with a scalar value head instead of the LM
head, so PPO's critic starts from the same weights as the policy (its features already read the
task) and only the head is new.

The head starts at zero, so the first values are 0 and the first GAE advantages are the plain
discounted returns: PPO begins as REINFORCE with a whitened baseline and the critic takes over as
it learns, instead of a random head injecting noise into the first updates. Its pass over a batch's
responses is engines/values.py's.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from rldock.runtime.models.loading import load_causal_lm
from rldock.runtime.models.pipeline_stage import StageParts, cut_stage


class ValueModel(nn.Module):
    stage_parts = StageParts(decoder="body", head="head")

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


def load_value_model(
    policy_dir: str | Path, *, dtype: str, device: torch.device | str, stage: tuple[int, int] | None = None
) -> ValueModel:
    """The causal LM at `policy_dir` without its LM head, plus a zero value head; under pipeline parallelism
    (`stage`: (stage, stages)) only that stage's part, the body read as models/loading.py reads a stage and
    the value head the last stage's alone."""
    lm = load_causal_lm(policy_dir, dtype=dtype, device=device, stage=stage, head=False)
    model = ValueModel(lm.base_model, lm.config.hidden_size)
    if stage is not None:
        cut_stage(model, index=stage[0], size=stage[1])
    return model.to(device=device, dtype=lm.dtype)
