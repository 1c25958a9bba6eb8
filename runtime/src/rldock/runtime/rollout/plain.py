"""The plain rollout: each batch of whole prompt groups in one engine call, N responses per prompt,
written to the dock when the whole batch has finished (rollout.stream_groups 0, the default)."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.rollout.protocol import (
    SAMPLED_LOGPROBS,
    RolloutMode,
    RolloutRequest,
    RolloutSetup,
    decode_steps,
    group_columns,
    group_prompts,
    group_request,
    run_rollout_stage,
    sampled_logprobs,
)


class PlainRollout(RolloutMode):
    def __init__(self, setup: RolloutSetup):
        self.setup = setup

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> StageResult:
        lengths: list[int] = []

        def rollout(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            completions = engine.sample(
                group_prompts(batch, self.setup.num_responses),
                **group_request(self.setup, indices, request, max_tokens=self.setup.max_response_length),
                logprobs=self.setup.keeps_logprobs,
            )
            per_prompt = [[c.token_ids for c in group] for group in completions]
            lengths.extend(len(tokens) for responses in per_prompt for tokens in responses)
            columns = group_columns(per_prompt, self.setup, policy_version=request.policy_version)
            if self.setup.keeps_logprobs:
                columns[SAMPLED_LOGPROBS] = sampled_logprobs(completions, self.setup.max_response_length)
            return columns

        timing = run_rollout_stage(
            dock, self.setup, rollout, policy_version=request.policy_version, batch_size=request.batch_size
        )
        return timing.with_metrics(decode_steps=decode_steps(lengths))
