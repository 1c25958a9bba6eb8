"""GAE over a multi-turn trajectory: token GAE that skips the tools' tokens, against a plain re-derivation
and against verl's recursion at the same masks; GAE by turn against a hand-computed case; the PPO stage
with an agent's turn columns."""

from pathlib import Path

import pytest
import torch
import yaml

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime.algorithms.gae import GAE_UNITS, GaeInputs, gae_advantages, outcome_token_rewards
from rldock.runtime.algorithms.turns import reward_split_over_turns, turn_token_rewards
from rldock.runtime.flow.catalogue import get_recipe

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"

# Every number below is float32 arithmetic on magnitudes <= 2 over <= 24 steps, compared with float64
# references: the rounding is below 24 steps x 3 operations x 2 x 2^-24 ~ 1e-5 of the largest term, and
# no reduction runs over threads (the recursion is a loop over positions), so it holds on any CPU.
ATOL = 1e-5


def _masks_with_gaps(generator: torch.Generator, rows: int, length: int) -> torch.Tensor:
    """(rows, length) 0/1 masks like a trajectory's: runs of model tokens, gaps of tool tokens, then pads."""
    masks = torch.zeros(rows, length, dtype=torch.int64)
    for row in range(rows):
        position, model = 0, True
        end = int(torch.randint(length // 2, length + 1, (1,), generator=generator))
        while position < end:
            run = int(torch.randint(1, 5, (1,), generator=generator))
            masks[row, position : min(position + run, end)] = int(model)
            position, model = position + run, not model
    return masks


def _plain_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """Textbook GAE over one episode's steps (float64): delta_i = r_i + gamma V_{i+1} - V_i, V_n = 0."""
    advantages, following = [0.0] * len(rewards), 0.0
    for i in reversed(range(len(rewards))):
        next_value = values[i + 1] if i + 1 < len(values) else 0.0
        following = rewards[i] + gamma * next_value - values[i] + gamma * lam * following
        advantages[i] = following
    return advantages


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (1.0, 0.0)])
def test_token_gae_skipping_tool_tokens_is_gae_over_the_model_tokens_alone(gamma, lam):
    generator = torch.Generator().manual_seed(7)
    mask = _masks_with_gaps(generator, 16, 24)  # (B, T)
    values = torch.rand(16, 24, generator=generator) * 2 - 1
    rewards = torch.rand(16, 24, generator=generator) * 2 - 1  # on tool tokens too: they must be ignored
    advantages, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam)
    for row in range(16):
        steps = mask[row].nonzero().squeeze(1).tolist()  # the model's positions, in order
        expected = _plain_gae(
            [float(rewards[row, t]) for t in steps], [float(values[row, t]) for t in steps], gamma, lam
        )
        reference = torch.zeros(24, dtype=torch.float64)
        reference[steps] = torch.tensor(expected, dtype=torch.float64)
        torch.testing.assert_close(advantages[row].double(), reference, rtol=0, atol=ATOL)
        value_steps = torch.zeros(24, dtype=torch.float64)
        value_steps[steps] = values[row, steps].double()
        torch.testing.assert_close(returns[row].double(), reference + value_steps, rtol=0, atol=ATOL)


def _verl_semantics(rewards, values, mask, gamma, lam):
    """verl's GAE with a response mask (verl/trainer/ppo/core_algos.py, compute_gae_advantage_return, read
    at commit 1dda039), restated here: walk the positions backwards; at every position the TD error uses
    the carried next value, and at a masked position both the next value and the running advantage are
    carried past unchanged, while the advantage stored there is the carried one. Returns = advantages +
    values everywhere. Before its whitening."""
    next_value = torch.zeros(values.shape[0], dtype=torch.float64)
    running = torch.zeros(values.shape[0], dtype=torch.float64)
    stored = []
    m = mask.double()
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * running
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        running = candidate * m[:, t] + (1 - m[:, t]) * running
        stored.append(running)
    advantages = torch.stack(stored[::-1], dim=1)
    return advantages, advantages + values


def test_token_gae_equals_verls_at_the_same_masks_on_the_model_tokens():
    """Equal on every model token (advantages and returns); off them verl keeps the carried advantage
    and advantage + value, where rldock writes 0 (nothing reads them: the losses mask them out)."""
    generator = torch.Generator().manual_seed(11)
    mask = _masks_with_gaps(generator, 16, 24)
    values = (torch.rand(16, 24, generator=generator) * 2 - 1).double()
    rewards = (torch.rand(16, 24, generator=generator) * 2 - 1).double()
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.97, lam=0.9)
    verl_advantages, verl_returns = _verl_semantics(rewards, values, mask, 0.97, 0.9)
    on = mask.bool()
    torch.testing.assert_close(advantages.double()[on], verl_advantages[on], rtol=0, atol=ATOL)
    torch.testing.assert_close(returns.double()[on], verl_returns[on], rtol=0, atol=ATOL)
    assert advantages[~on].eq(0).all() and returns[~on].eq(0).all()


def test_outcome_reward_sits_on_the_last_model_token_past_tool_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    rewards = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 1, 0, 0], [0, 0, 2, 0, 0, 0, 0], [0] * 7]


# Row 0: turn 0 on tokens 0-1, a tool's tokens 2-3, turn 1 on tokens 4-5, padding 6-7. Row 1: one turn.
TURN_INDEX = torch.tensor([[0, 0, -1, -1, 1, 1, -1, -1], [0, 0, 0, -1, -1, -1, -1, -1]])
MASK = (TURN_INDEX >= 0).long()
VALUES = torch.tensor([[0.5, 9.0, 9.0, 9.0, 0.25, 9.0, 9.0, 9.0], [0.4, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0]])
TURN_REWARDS = torch.tensor([[0.2, 1.0], [0.5, 0.0]])


def test_turn_gae_hand_computed():
    # gamma 0.9, lambda 0.8. Row 0: V_0 = 0.5, V_1 = 0.25 (the turns' first tokens; the 9s are never read).
    # delta_1 = 1 - 0.25 = 0.75 = A_1; delta_0 = 0.2 + 0.9 * 0.25 - 0.5 = -0.075, A_0 = -0.075 + 0.72 * 0.75
    # = 0.465; R_0 = 0.965, R_1 = 1.0. Row 1: A_0 = 0.5 - 0.4 = 0.1, R_0 = 0.5.
    gae = GAE_UNITS.get("turn")(GaeInputs(TURN_REWARDS, VALUES, MASK, TURN_INDEX), gamma=0.9, lam=0.8)
    expected = [[0.465, 0.465, 0, 0, 0.75, 0.75, 0, 0], [0.1, 0.1, 0.1, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(gae.advantages, torch.tensor(expected), rtol=0, atol=ATOL)
    returns = [[0.965, 0, 0, 0, 1.0, 0, 0, 0], [0.5, 0, 0, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(gae.returns, torch.tensor(returns), rtol=0, atol=ATOL)
    assert gae.value_mask.tolist() == [[1, 0, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]


def test_token_gae_puts_each_turns_reward_on_its_last_token_and_trains_every_model_token():
    assert turn_token_rewards(TURN_REWARDS, TURN_INDEX).tolist() == [
        [0, pytest.approx(0.2), 0, 0, 0, 1.0, 0, 0],
        [0, 0, 0.5, 0, 0, 0, 0, 0],
    ]
    gae = GAE_UNITS.get("token")(GaeInputs(TURN_REWARDS, VALUES, MASK, TURN_INDEX), gamma=1.0, lam=1.0)
    # lambda 1, gamma 1: A_t = (rewards from t on) - V_t on the model's tokens.
    expected = [[1.2 - 0.5, 1.2 - 9.0, 0, 0, 1.0 - 0.25, 1.0 - 9.0, 0, 0], [0.5 - 0.4, 0.5 - 9, 0.5 - 9, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(gae.advantages, torch.tensor(expected), rtol=0, atol=ATOL)
    assert torch.equal(gae.value_mask, MASK)


def _ppo(**algorithm):
    """The algorithm section alone: the stage's input (a whole job with credit: turn needs an agent)."""
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["algorithm"].update(name="ppo", num_prompts_per_iteration=1, num_responses_per_prompt=2, **algorithm)
    return AlgorithmSpec.model_validate(data["algorithm"])


@pytest.mark.parametrize(("credit", "gae_unit"), [("trajectory", "token"), ("turn", "token"), ("turn", "turn")])
def test_the_ppo_stage_reads_the_turns_as_credit_and_gae_unit_say(credit, gae_unit):
    algo = _ppo(credit=credit, gae_unit=gae_unit, ppo={"gamma": 0.9, "lam": 0.8, "whiten_advantages": False})
    batch = {
        "reward": torch.tensor([1.2, 0.5]),
        "response_mask": MASK,
        "values": VALUES,
        "turn_index": TURN_INDEX,
        "turn_rewards": torch.tensor([[0.2, 0.0], [0.0, 0.0]]),  # the environment paid turn 0 of row 0
    }
    out = get_recipe("ppo").advantage_stage(batch, algo, torch.Generator())
    per_turn = (
        reward_split_over_turns(batch["reward"], batch["turn_rewards"], TURN_INDEX)
        if credit == "turn"
        else torch.tensor([[0.0, 1.2], [0.5, 0.0]])
    )
    if credit == "turn":
        assert torch.allclose(per_turn, TURN_REWARDS)  # 0.2 where the step paid it, the rest (1.0) on the last
    gae = GAE_UNITS.get(gae_unit)(GaeInputs(per_turn, VALUES, MASK, TURN_INDEX), gamma=0.9, lam=0.8)
    torch.testing.assert_close(out["advantage"], gae.advantages)
    torch.testing.assert_close(out["returns"], gae.returns)
    assert torch.equal(out["value_mask"], gae.value_mask)


def test_the_ppo_stage_without_turn_columns_is_single_turn_gae():
    algo = _ppo(ppo={"gamma": 1.0, "lam": 0.5, "whiten_advantages": False})
    batch = {"reward": torch.tensor([1.0]), "response_mask": torch.tensor([[1, 1, 1]]), "values": torch.zeros(1, 3)}
    out = get_recipe("ppo").advantage_stage(batch, algo, torch.Generator())
    # delta = [0, 0, 1], A_t = 0.5 * A_{t+1} + delta_t
    torch.testing.assert_close(out["advantage"], torch.tensor([[0.25, 0.5, 1.0]]))
    assert out["value_mask"].tolist() == [[1, 1, 1]]


def test_the_pf_ppo_stage_trains_the_critic_on_the_turns_of_every_response():
    algo = _ppo(gae_unit="turn", ppo={"gamma": 0.9, "lam": 0.8, "whiten_advantages": False})
    algo = algo.model_copy(update={"name": "pf_ppo"})
    batch = {
        "reward": torch.tensor([1.2, 0.5]),
        "response_mask": MASK,
        "values": VALUES,
        "turn_index": TURN_INDEX,
        "turn_rewards": torch.zeros(2, 2),
    }
    out = get_recipe("pf_ppo").advantage_stage(batch, algo, torch.Generator().manual_seed(0))
    per_turn = torch.tensor([[0.0, 1.2], [0.5, 0.0]])  # credit trajectory: each reward on its last turn
    gae = GAE_UNITS.get("turn")(GaeInputs(per_turn, VALUES, MASK, TURN_INDEX), gamma=0.9, lam=0.8)
    torch.testing.assert_close(out["returns"], gae.returns)  # the filtered response's too
    assert torch.equal(out["value_mask"], gae.value_mask)
    kept = (out["loss_weight"] > 0).unsqueeze(1)  # best_worst of a group of 2 keeps both
    torch.testing.assert_close(out["advantage"], gae.advantages * kept)
