"""One record for a multi-turn episode's dock row, whoever ran the episode, and the one writer of its columns.

The native agent loop (agent/episode_loop.py's `Episode`, one row per episode: rollout/agent_episodes.py) and a
user's harness through the gateway (gateway/sessions.py's segments, one row per kept segment: rollout/harness.py)
each give their rows as `Trajectory`s, and `trajectory_columns` makes the dock's columns of them: the response
and its masks, the trajectory's counts and the environment's per-step rewards, the turns
(agent/trajectory.py's `turn_columns`), each token's version and sampling logprob where the job's rollout
writes them, and a row's own prompt where it is not the driver's (a harness's segment continues its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rldock.runtime.agent.trajectory import turn_columns
from rldock.runtime.flow.columns import AGENT_PARTIAL_ROLLOUT

SAMPLED_LOGPROBS, TOKEN_POLICY_VERSION = AGENT_PARTIAL_ROLLOUT


@dataclass(frozen=True)
class Trajectory:
    """A multi-turn episode as one dock row: every token after the prompt (`response`), which of them the
    model sampled (`model_mask`), per token the model turn it is of (`turn_index`, -1 elsewhere) and the
    version that sampled it with its logprob then (`versions`, -1, and `logprobs`, 0.0, elsewhere); per turn
    its step's reward (`turn_rewards`); the environment's reward for each step (`rewards`); the counts the
    reward sees; and `prompt`, the row's own prompt where it is not the one the driver put (None: the
    driver's)."""

    response: Sequence[int]
    model_mask: Sequence[int]
    turn_index: Sequence[int]
    turn_rewards: Sequence[float]
    rewards: Sequence[float]
    num_turns: int
    num_tool_calls: int
    num_tool_errors: int = 0
    versions: Sequence[int] = ()
    logprobs: Sequence[float] = ()
    prompt: Sequence[int] | None = None


def trajectory_columns(
    trajectories: Sequence[Trajectory],
    *,
    max_response_length: int,
    max_turns: int,
    pad_token_id: int,
    policy_version: int,
    engine_columns: Sequence[str] = (),
    prompt_capacity: int | None = None,
) -> TensorDict:
    """The dock's columns of `trajectories`, one row each: the response ones (B, `max_response_length`),
    the counts, the environment's rewards (B, `max_turns`), the turns, those of each token's version and
    sampling logprob named in `engine_columns` (AGENT_PARTIAL_ROLLOUT), and with `prompt_capacity` each row's
    own prompt, left-padded to it."""
    rows = len(trajectories)
    response_ids = torch.full((rows, max_response_length), pad_token_id, dtype=torch.int64)  # (B, SL)
    model_mask = torch.zeros((rows, max_response_length), dtype=torch.int64)  # (B, SL)
    attention = torch.zeros((rows, max_response_length), dtype=torch.int64)  # (B, SL)
    rewards = torch.zeros((rows, max_turns), dtype=torch.float32)  # (B, max_turns): the environment's per step
    for row, trajectory in enumerate(trajectories):
        length = len(trajectory.response)
        assert length <= max_response_length, f"a trajectory of {length} tokens for rows of {max_response_length}"
        response_ids[row, :length] = torch.tensor(trajectory.response, dtype=torch.int64)
        model_mask[row, :length] = torch.tensor(trajectory.model_mask, dtype=torch.int64)
        attention[row, :length] = 1
        rewards[row, : len(trajectory.rewards)] = torch.tensor(trajectory.rewards, dtype=torch.float32)

    def counts(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)  # (B,)

    columns = TensorDict(
        {
            "response_ids": response_ids,
            "response_mask": model_mask,
            "response_attention_mask": attention,
            "response_length": attention.sum(dim=1),  # (B,) every token after the prompt
            "policy_version": torch.full((rows,), policy_version, dtype=torch.int64),
            "num_turns": counts([t.num_turns for t in trajectories]),
            "num_tool_calls": counts([t.num_tool_calls for t in trajectories]),
            "num_tool_errors": counts([t.num_tool_errors for t in trajectories]),
            "environment_rewards": rewards,
            "num_environment_steps": counts([len(t.rewards) for t in trajectories]),
            **turn_columns(
                [t.turn_index for t in trajectories],
                [t.turn_rewards for t in trajectories],
                max_response_length=max_response_length,
                max_turns=max_turns,
            ),
        },
        batch_size=[rows],
    )
    if prompt_capacity is not None:
        prompt_ids = torch.full((rows, prompt_capacity), pad_token_id, dtype=torch.int64)  # (B, PL)
        prompt_mask = torch.zeros_like(prompt_ids)
        for row, trajectory in enumerate(trajectories):
            assert trajectory.prompt is not None, "a row written with its own prompt columns needs its prompt"
            if trajectory.prompt:
                prompt_ids[row, -len(trajectory.prompt) :] = torch.tensor(trajectory.prompt, dtype=torch.int64)
                prompt_mask[row, -len(trajectory.prompt) :] = 1
        columns.update({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask})
    if engine_columns:
        per_token = version_columns(
            [t.versions for t in trajectories],
            [t.logprobs for t in trajectories],
            max_response_length=max_response_length,
        )
        columns.update({name: per_token[name] for name in engine_columns})
    return columns


def version_columns(
    versions: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], *, max_response_length: int
) -> dict[str, torch.Tensor]:
    """Per row, from each response token's version (-1 where the model did not sample it) and logprob:
    `token_policy_version` (B, SL) int64: the policy version that sampled each response token, -1 on the
    tools', the environment's, the context's and padding tokens; `sampled_logprobs` (B, SL) float32: each
    model token's logprob under the weights that sampled it, 0 elsewhere."""
    rows = len(versions)
    token_versions = torch.full((rows, max_response_length), -1, dtype=torch.int64)  # (B, SL)
    sampled = torch.zeros((rows, max_response_length), dtype=torch.float32)  # (B, SL)
    for row, (row_versions, row_logprobs) in enumerate(zip(versions, logprobs)):
        token_versions[row, : len(row_versions)] = torch.tensor(row_versions, dtype=torch.int64)
        sampled[row, : len(row_logprobs)] = torch.tensor(row_logprobs, dtype=torch.float32)
    return {TOKEN_POLICY_VERSION: token_versions, SAMPLED_LOGPROBS: sampled}
