"""PPO and PF-PPO pieces on hand-computed numbers: GAE, value clipping, policy filtration, and
the recipes that wire them (docs/algorithms/ppo.md, docs/algorithms/pf-ppo.md)."""

import copy
from pathlib import Path

import pytest
import torch
import yaml

from rldock.config import ConfigError, parse_job_config
from rldock.contract.algorithms import CATALOGUE
from rldock.runtime.algorithms import clipped_policy_loss, grpo_advantages
from rldock.runtime.algorithms.filtration import FILTRATION_MODES, filtration_weights
from rldock.runtime.algorithms.gae import gae_advantages, masked_whiten, outcome_token_rewards
from rldock.runtime.algorithms.value_loss import clipped_value_loss
from rldock.runtime.flow.catalogue import RECIPES, get_recipe

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"


# --- GAE ---------------------------------------------------------------------------------------


def test_outcome_reward_sits_on_the_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    got = outcome_token_rewards(torch.tensor([1.0, 0.5, 0.7]), mask)
    assert torch.equal(got, torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gae_hand_computed():
    # gamma 1, lambda 0.5. Row 0, values [0.5, 0.25, 0.75], reward 1 on token 2:
    #   d2 = 1 - 0.75 = 0.25, A2 = 0.25
    #   d1 = 0.75 - 0.25 = 0.5, A1 = 0.5 + 0.5 * 0.25 = 0.625
    #   d0 = 0.25 - 0.5 = -0.25, A0 = -0.25 + 0.5 * 0.625 = 0.0625
    # Row 1 ends at token 1 (its pad value 9 must not leak), values [1, 0.5], reward 0.5:
    #   d1 = 0.5 - 0.5 = 0, A1 = 0;  d0 = 0.5 - 1 = -0.5, A0 = -0.5
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    values = torch.tensor([[0.5, 0.25, 0.75], [1.0, 0.5, 9.0]])
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.5]), mask)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.5)
    assert torch.allclose(advantages, torch.tensor([[0.0625, 0.625, 0.25], [-0.5, 0.0, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[0.5625, 0.875, 1.0], [0.5, 0.5, 0.0]]))


def test_gae_with_lambda_1_and_zero_values_is_the_discounted_return():
    mask = torch.ones(1, 3)
    rewards = outcome_token_rewards(torch.tensor([1.0]), mask)
    advantages, returns = gae_advantages(rewards, torch.zeros(1, 3), mask, gamma=0.5, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[0.25, 0.5, 1.0]]))
    assert torch.allclose(returns, advantages)


def test_gae_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)


def test_masked_whiten_ignores_pads():
    got = masked_whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]))
    assert torch.allclose(got, torch.tensor([[-1.0, 1.0, 0.0]]), atol=1e-4)


# --- value loss --------------------------------------------------------------------------------


def test_clipped_value_loss_hand_computed():
    # clip 0.2. tok0: V 2 vs R 1.5 -> 0.25; V_clip = 1.2 -> 0.09; max 0.25 (unclipped).
    # tok1: V 0 = V_old, error 1 either way. tok2: V 2 vs R 3 -> 1; V_clip 1.2 -> 3.24 (clipped
    # taken: the value jumped past the clip, so it gets no gradient). tok3 is padding.
    values = torch.tensor([[2.0, 0.0, 2.0, 7.0]], requires_grad=True)
    old = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 3.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = clipped_value_loss(values, old, returns, mask, value_clip=0.2)
    assert out.loss.item() == pytest.approx(0.5 * (0.25 + 1.0 + 3.24) / 3)
    assert out.clip_fraction.item() == pytest.approx(1 / 3)
    out.loss.backward()
    # d/dV of 0.5 * (V - R)^2 / 3 on the unclipped tokens; 0 on the clipped one and the pad.
    assert torch.allclose(values.grad, torch.tensor([[0.5 / 3, -1 / 3, 0.0, 0.0]]))


def test_value_loss_without_movement_is_half_the_squared_error():
    values = torch.tensor([[0.5, 0.5]])
    out = clipped_value_loss(values, values, torch.tensor([[1.5, 0.5]]), torch.ones(1, 2), value_clip=0.1)
    assert out.loss.item() == pytest.approx(0.5 * 1.0 / 2)
    assert out.clip_fraction.item() == 0.0


# --- policy loss with per-token advantages -------------------------------------------------------


def test_policy_loss_takes_per_token_advantages():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    per_token = clipped_policy_loss(logprobs, logprobs, torch.tensor([[1.0, -3.0, 50.0]]), mask, clip_ratio=0.2)
    # ratio 1 everywhere: loss = -mean(advantage) over valid tokens = -(1 - 3) / 2
    assert per_token.loss.item() == pytest.approx(1.0)
    broadcast = clipped_policy_loss(logprobs, logprobs, torch.tensor([[2.0, 2.0, 2.0]]), mask, clip_ratio=0.2)
    per_response = clipped_policy_loss(logprobs, logprobs, torch.tensor([2.0]), mask, clip_ratio=0.2)
    assert broadcast.loss.item() == per_response.loss.item() == pytest.approx(-2.0)
    with pytest.raises(ValueError, match="one per token"):
        clipped_policy_loss(logprobs, logprobs, torch.zeros(1, 2), mask, clip_ratio=0.2)


# --- PF-PPO filtration -------------------------------------------------------------------------

REWARDS = torch.tensor([0.2, 0.9, 0.5, 0.9, 0.0, 0.0, 0.0, 0.0])  # two groups of 4


def test_best_of_n_keeps_each_groups_best_first_on_ties():
    # kept: index 1 (0.9 ties with index 3; lower index wins) and index 4 (all equal).
    # Two of eight kept, rescaled to mean 1: weight 4 each.
    got = filtration_weights(REWARDS, 4, "best_of_n")
    assert torch.equal(got, torch.tensor([0.0, 4.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0]))


def test_best_worst_keeps_best_and_worst_once_for_an_all_equal_group():
    # group 0: best 1, worst 0; group 1: best == worst == 4. Three kept: 8/3 each.
    got = filtration_weights(REWARDS, 4, "best_worst")
    k = 8 / 3
    assert torch.allclose(got, torch.tensor([k, k, 0.0, 0.0, k, 0.0, 0.0, 0.0]))


def test_pow_weights_by_reward_power():
    # raw = r^2 = [0.04, 0.81, 0.25, 0.81, 0, 0, 0, 0], sum 1.91, rescaled by 8 / 1.91
    got = filtration_weights(REWARDS, 4, "pow", power=2.0)
    expected = torch.tensor([0.04, 0.81, 0.25, 0.81, 0.0, 0.0, 0.0, 0.0]) * (8 / 1.91)
    assert torch.allclose(got, expected)
    assert got.mean().item() == pytest.approx(1.0)


def test_pow_with_all_rewards_zero_trains_nothing():
    assert torch.equal(filtration_weights(torch.zeros(4), 2, "pow"), torch.zeros(4))


def test_best_random_keeps_the_best_and_one_uniform_other():
    drawn = set()
    for seed in range(40):
        got = filtration_weights(REWARDS, 4, "best_random", generator=torch.Generator().manual_seed(seed))
        groups = got.view(2, 4)
        assert groups[0, 1] == 2.0 and groups[1, 0] == 2.0  # each best kept; 2 of 4 kept per group
        assert (groups > 0).sum(dim=1).tolist() == [2, 2]
        (other,) = [i for i in torch.nonzero(groups[0]).flatten().tolist() if i != 1]
        drawn.add(other)
        again = filtration_weights(REWARDS, 4, "best_random", generator=torch.Generator().manual_seed(seed))
        assert torch.equal(got, again)
    assert drawn == {0, 2, 3}  # every other response of group 0 gets drawn at some seed


def test_unknown_filtration_mode_names_the_field():
    with pytest.raises(ValueError, match="algorithm.pf_ppo.mode"):
        filtration_weights(REWARDS, 4, "top_k")
    assert list(FILTRATION_MODES) == ["best_of_n", "best_random", "best_worst", "pow"]


# --- recipes -----------------------------------------------------------------------------------


def _algo(name: str, **overrides):
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["algorithm"].update(name=name, num_prompts_per_iteration=1, num_responses_per_prompt=2, **overrides)
    return parse_job_config(data).algorithm


def test_grpo_recipe_is_todays_flow():
    recipe = get_recipe("grpo")
    assert recipe.states == (
        "rollout",
        "actor_inference",
        "reference",
        "reward",
        "advantage",
        "update",
        "sample_facts",
    )
    assert not recipe.needs_critic and recipe.policy_loss == "clipped"
    rewards = torch.tensor([1.0, 0.0])
    out = recipe.advantage_stage({"reward": rewards}, _algo("grpo"), torch.Generator())
    assert torch.equal(out["advantage"], grpo_advantages(rewards, 2))


@pytest.mark.parametrize("name", ["grpo", "ppo", "pf_ppo"])
def test_recipe_flow_is_closed(name):
    recipe = get_recipe(name)
    produced = {column for columns in recipe.produces.values() for column in columns}
    for state, columns in recipe.consumes.items():
        assert set(columns) <= produced, state
        assert state in recipe.produces, state


def test_the_recipes_are_the_contracts_algorithm_catalogue():
    assert set(RECIPES) == set(CATALOGUE)
    for name in RECIPES:
        recipe = get_recipe(name)
        assert recipe.needs_critic == CATALOGUE[name].needs_critic, name
        assert recipe.needs_rollout_engine == CATALOGUE[name].needs_rollout, name


def test_ppo_stage_writes_gae_advantages_and_returns():
    algo = _algo("ppo", ppo={"gamma": 1.0, "lam": 0.5, "whiten_advantages": False})
    batch = {
        "reward": torch.tensor([1.0, 0.5]),
        "response_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "values": torch.tensor([[0.5, 0.25, 0.75], [1.0, 0.5, 9.0]]),
    }
    out = get_recipe("ppo").advantage_stage(batch, algo, torch.Generator())
    assert torch.allclose(out["advantage"], torch.tensor([[0.0625, 0.625, 0.25], [-0.5, 0.0, 0.0]]))
    assert torch.allclose(out["returns"], torch.tensor([[0.5625, 0.875, 1.0], [0.5, 0.5, 0.0]]))


def test_pf_ppo_stage_zeroes_filtered_responses_but_keeps_all_returns():
    algo = _algo("pf_ppo", ppo={"gamma": 1.0, "lam": 1.0, "whiten_advantages": False}, pf_ppo={"mode": "best_of_n"})
    batch = {
        "reward": torch.tensor([0.25, 1.0]),
        "response_mask": torch.ones(2, 2, dtype=torch.int64),
        "values": torch.zeros(2, 2),
    }
    out = get_recipe("pf_ppo").advantage_stage(batch, algo, torch.Generator())
    # Only response 1 (reward 1) is kept, with weight 2 (one of two kept, mean 1): the weight goes to
    # the loss aggregation (loss_weight), the advantage of the filtered response is 0.
    assert torch.allclose(out["advantage"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert torch.equal(out["loss_weight"], torch.tensor([0.0, 2.0]))
    assert torch.allclose(out["returns"], torch.tensor([[0.25, 0.25], [1.0, 1.0]]))


def test_unknown_recipe_lists_the_valid_ones():
    with pytest.raises(ValueError, match="algorithm.name 'a2c'.*grpo"):
        get_recipe("a2c")


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize("example", ["ppo-tiny.yaml", "pf-ppo-tiny.yaml"])
def test_examples_are_valid(example):
    cfg = parse_job_config(yaml.safe_load((EXAMPLES / example).read_text()))
    assert get_recipe(cfg.algorithm.name).needs_critic


def test_a_critic_needs_a_device_beyond_the_dp_ranks():
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["resources"]["devices_per_node"] = data["training"]["data_parallel_size"]
    parse_job_config(copy.deepcopy(data))  # GRPO fits: actor + reference share each device
    data["algorithm"]["name"] = "ppo"
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    (problem,) = caught.value.problems
    assert problem.path == "resources.devices_per_node" and "critic" in problem.message
