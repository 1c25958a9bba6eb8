"""The agent rollout (a job with an `agent` section): one multi-turn episode per sample, with tools
and an environment, run by the rank's AgentSampler (rldock.runtime.agent_sampler); the episodes'
trajectories and counts become the dock's columns, written when the rank's batch has ended. Held-out
evaluation runs episodes too, and answers with each one's final turn."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.runtime.agent.metrics import Sums, merged_sums
from rldock.runtime.agent_sampler import AgentSampler
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageFn
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.rollout.base import (
    HeldOutRequest,
    RolloutMode,
    RolloutRequest,
    RolloutSetup,
    run_rollout_stage,
    unpadded,
)


class AgentRollout(RolloutMode):
    def __init__(self, setup: RolloutSetup, sampler: AgentSampler):
        self.setup, self.sampler = setup, sampler

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> dict:
        lengths: list[int] = []
        sums: list[Sums] = []

        def rollout(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            columns, batch_sums, batch_lengths = self.sampler.rollout(
                engine,
                unpadded(batch["prompt_ids"], batch["prompt_mask"]),
                keys=episode_keys(self.setup, indices, request),
                prompt_indices=batch["prompt_index"].tolist(),
                seed=request.iteration,
                policy_version=request.policy_version,
            )
            sums.append(batch_sums)
            lengths.extend(batch_lengths)
            return columns

        return episode_stage(dock, self.setup, rollout, request=request, lengths=lengths, sums=sums)

    def evaluate(self, engine: VllmRolloutEngine, request: HeldOutRequest) -> dict:
        """Also each episode's `environment_rewards` per step and the episodes' metric sums (`agent`).
        An episode's length is the agent's (algorithm.max_response_length over all its turns), not
        the request's `max_tokens`."""
        k = request.num_samples
        prompts, contexts = request.prompts, request.contexts or [None] * len(request.prompts)
        finals, sums, rewards = self.sampler.evaluate(
            engine,
            [prompt for prompt in prompts for _ in range(k)],
            keys=[key * k + j for key in request.prompt_keys for j in range(k)],
            contexts=[c for c in contexts for _ in range(k)],
            seed=request.seed,
            greedy=request.greedy,
        )
        return {
            "responses": [finals[i : i + k] for i in range(0, len(finals), k)],
            "environment_rewards": [rewards[i : i + k] for i in range(0, len(rewards), k)],
            "agent": sums,
        }


def episode_keys(setup: RolloutSetup, indices: torch.Tensor, request: RolloutRequest) -> list[int]:
    """One episode per sample at dock `indices` (B,): seeded by its index, offset per DAPO round."""
    return (indices + request.sampling_round * setup.num_samples_per_iteration).tolist()


def episode_stage(
    dock: TransferDock,
    setup: RolloutSetup,
    rollout: StageFn,
    *,
    request: RolloutRequest,
    lengths: list[int],
    sums: list[Sums],
) -> dict:
    """Run `rollout` (which fills `lengths` and `sums` as it goes) as the rollout stage: its timing with the
    episodes' response lengths and metric sums (`agent`)."""
    timing = run_rollout_stage(dock, setup, rollout, policy_version=request.policy_version)
    timing.extra["response_lengths"] = lengths
    if sums:
        timing.extra["agent"] = merged_sums(sums)
    return timing.as_dict()
