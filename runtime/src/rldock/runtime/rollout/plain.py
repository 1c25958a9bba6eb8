"""The plain rollout: each batch of whole prompt groups in one engine call, N responses per prompt,
written to the dock when the whole batch has finished (rollout.stream_groups 0, the default)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.runtime.dock import TransferDock
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.rollout.base import (
    RolloutMode,
    RolloutRequest,
    RolloutSetup,
    group_columns,
    group_prompts,
    group_request,
    run_rollout_stage,
)


class PlainRollout(RolloutMode):
    def __init__(self, setup: RolloutSetup):
        self.setup = setup

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> dict:
        lengths: list[int] = []

        def rollout(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            per_prompt = engine.generate(
                group_prompts(batch, self.setup.num_responses),
                **group_request(self.setup, indices, request, max_tokens=self.setup.max_response_length),
            )
            lengths.extend(len(tokens) for responses in per_prompt for tokens in responses)
            return group_columns(per_prompt, self.setup, policy_version=request.policy_version)

        timing = run_rollout_stage(dock, self.setup, rollout, policy_version=request.policy_version)
        timing.extra["response_lengths"] = lengths
        return timing.as_dict()
