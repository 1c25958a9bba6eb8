"""The streamed rollout (rollout.stream_groups > 0): each batch of whole prompt groups in one engine
batch, as the plain rollout, but groups are written to the dock as they finish, `stream_groups` at
a time, so the stages after the rollout start on them while the rest still generate. The engine's
`stream` gives the same responses as its `sample` (same seeds), so only the timing differs; where the
job recipe's rollout state writes the engine's logprobs (the mismatch's measure), each group's go with it."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.engines.vllm_rollout import Completion, VllmRolloutEngine
from rldock.runtime.rollout.protocol import (
    SAMPLED_LOGPROBS,
    RolloutMode,
    RolloutRequest,
    RolloutSetup,
    TimedWrites,
    decode_steps,
    group_columns,
    group_prompts,
    group_request,
    run_rollout_stage,
    sampled_logprobs,
)


class StreamedRollout(RolloutMode):
    def __init__(self, setup: RolloutSetup, *, stream_groups: int):
        assert stream_groups >= 1, f"a streamed rollout writes at least 1 group, got {stream_groups}"
        self.setup, self.stream_groups = setup, stream_groups

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> StageResult:
        group = self.setup.num_responses
        lengths: list[int] = []
        writes = TimedWrites(dock)

        def rollout(indices: torch.Tensor, batch: TensorDict) -> None:
            prompts = group_prompts(batch, group)
            engine_args = group_request(self.setup, indices, request, max_tokens=self.setup.max_response_length)
            finished: list[tuple[int, list[Completion]]] = []  # (prompt position, its N completions)
            written = 0  # groups of this batch already in the dock
            keeps_logprobs = self.setup.keeps_logprobs
            for position, completions in engine.stream(prompts, **engine_args, logprobs=keeps_logprobs):
                finished.append((position, completions))
                if len(finished) == self.stream_groups or written + len(finished) == len(prompts):
                    written += len(finished)
                    rows = torch.cat([indices[p * group : (p + 1) * group] for p, _ in finished])  # (k*N,)
                    per_prompt = [[c.token_ids for c in group] for _, group in finished]
                    lengths.extend(len(tokens) for responses in per_prompt for tokens in responses)
                    out = group_columns(per_prompt, self.setup, policy_version=request.policy_version)
                    if keeps_logprobs:
                        out[SAMPLED_LOGPROBS] = sampled_logprobs(
                            [group for _, group in finished], self.setup.max_response_length
                        )
                    writes.put(rows, out, policy_version=request.policy_version)
                    finished = []
            return None  # every group was written above

        timing = run_rollout_stage(
            dock,
            self.setup,
            rollout,
            policy_version=request.policy_version,
            writes=writes,
            batch_size=request.batch_size,
        )
        return timing.with_metrics(decode_steps=decode_steps(lengths))
