"""The one writer of a multi-turn episode's dock row (rollout/trajectory_rows.py), by hand: what the native
loop's episodes and a harness's segments both become."""

from __future__ import annotations

import torch

from rldock.runtime.rollout.trajectory_rows import Trajectory, trajectory_columns

PAD = 0


def two_turns() -> Trajectory:
    # the model's turn [5, 6], a tool's reply [7], the model's turn [8]; the environment's step after turn 1
    return Trajectory(
        response=[5, 6, 7, 8],
        model_mask=[1, 1, 0, 1],
        turn_index=[0, 0, -1, 1],
        turn_rewards=[0.0, 1.0],
        rewards=[1.0],
        num_turns=2,
        num_tool_calls=1,
        num_tool_errors=1,
        versions=[3, 3, -1, 4],
        logprobs=[-0.5, -0.25, 0.0, -1.0],
        prompt=[2, 9],
    )


def test_a_trajectory_is_one_row_of_every_column():
    empty = Trajectory(
        response=[], model_mask=[], turn_index=[], turn_rewards=[], rewards=[], num_turns=0, num_tool_calls=0, prompt=[]
    )
    columns = trajectory_columns(
        [two_turns(), empty], max_response_length=5, max_turns=3, pad_token_id=PAD, policy_version=3
    )
    assert columns["response_ids"].tolist() == [[5, 6, 7, 8, PAD], [PAD] * 5]
    assert columns["response_mask"].tolist() == [[1, 1, 0, 1, 0], [0] * 5]
    assert columns["response_attention_mask"].tolist() == [[1, 1, 1, 1, 0], [0] * 5]
    assert columns["response_length"].tolist() == [4, 0] and columns["policy_version"].tolist() == [3, 3]
    assert columns["num_turns"].tolist() == [2, 0] and columns["num_tool_calls"].tolist() == [1, 0]
    assert columns["num_tool_errors"].tolist() == [1, 0] and columns["num_environment_steps"].tolist() == [1, 0]
    assert columns["environment_rewards"].tolist() == [[1.0, 0.0, 0.0], [0.0] * 3]
    assert columns["turn_index"].tolist() == [[0, 0, -1, 1, -1], [-1] * 5]
    assert columns["turn_rewards"].tolist() == [[0.0, 1.0, 0.0], [0.0] * 3]
    assert "prompt_ids" not in columns.keys() and "token_policy_version" not in columns.keys()


def test_its_own_prompt_left_padded_and_each_tokens_version_where_asked():
    columns = trajectory_columns(
        [two_turns()],
        max_response_length=5,
        max_turns=2,
        pad_token_id=PAD,
        policy_version=3,
        engine_columns=("sampled_logprobs", "token_policy_version"),
        prompt_capacity=4,
    )
    assert columns["prompt_ids"].tolist() == [[PAD, PAD, 2, 9]] and columns["prompt_mask"].tolist() == [[0, 0, 1, 1]]
    assert columns["token_policy_version"].tolist() == [[3, 3, -1, 4, -1]]
    assert torch.equal(columns["sampled_logprobs"], torch.tensor([[-0.5, -0.25, 0.0, -1.0, 0.0]]))
