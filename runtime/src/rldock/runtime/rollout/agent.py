"""The agent rollout (a job with an `agent` section): one multi-turn episode per sample, with tools
and an environment, run by the rank's AgentSampler (rldock.runtime.rollout.agent_episodes); the episodes'
trajectories and counts become the dock's columns, written when the rank's batch has ended. Held-out
evaluation runs episodes too, and answers with each one's final turn.

With partial rollout (rollout.partial_rollout resume) the generation that runs ahead of a weight update
is the episodes' first round: each episode stops after rollout.max_tokens_per_round sampled tokens (the
turn being sampled cut there, its tools and environment step still running, its session open), and the
second round, after the update, runs them to their ends on the new weights (agent/episode_loop.py,
"Rounds"); rollout/episode_rounds.py holds what every episode source does around its rounds.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from tensordict import TensorDict

from rldock.runtime.agent.episode_loop import Rollout
from rldock.runtime.data.row_column import rows_from_column
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.flow.columns import PROMPT_ROW
from rldock.runtime.rollout.agent_episodes import AgentSampler
from rldock.runtime.rollout.episode_rounds import EpisodeRounds, Written, episode_keys
from rldock.runtime.rollout.protocol import HeldOutRequest, RolloutRequest, RolloutSetup, unpadded


class AgentRollout(EpisodeRounds):
    """The native agent loop as an episode source (rollout/episode_rounds.py holds the rounds)."""

    def __init__(self, setup: RolloutSetup, sampler: AgentSampler):
        super().__init__(setup)
        self.sampler = sampler

    def start(
        self, engine: VllmRolloutEngine, indices: torch.Tensor, batch: TensorDict, request: RolloutRequest
    ) -> Rollout:
        return self.sampler.start(
            engine,
            unpadded(batch["prompt_ids"], batch["prompt_mask"]),
            keys=episode_keys(self.setup, indices, request),
            rows=rows_from_column(batch[PROMPT_ROW[0]]),
            seed=request.iteration,
        )

    def advance(
        self, engine: VllmRolloutEngine, episodes: Rollout, *, policy_version: int, round_tokens: int | None = None
    ) -> bool:
        self.sampler.advance(engine, episodes, policy_version=policy_version, round_tokens=round_tokens)
        return episodes.done

    def columns(self, engine: VllmRolloutEngine, episodes: Rollout, *, policy_version: int) -> Written:
        return self.sampler.columns(engine, episodes, policy_version=policy_version)

    def running(self, episodes: Rollout) -> Collection[int]:
        """Those with a turn to sample and those whose tools or environment step are still out (an episode
        with two calls out counts once)."""
        return {*episodes.waiting, *episodes.out.values()}

    def sampled_tokens(self, episodes: Rollout, keys: Collection[int]) -> int:
        return sum(episodes.episodes[i].num_sampled_tokens for i in keys)

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
