"""Driver batches (prompt groups, preference pairs) and DAPO's dynamic sampling rounds."""

import pytest
import torch
from tensordict import TensorDict

from rldock.config.job import AlgorithmSpec
from rldock.runtime.algorithms.dapo import informative_groups
from rldock.runtime.sampling import DriverBatch, DynamicSampling, merge_rounds, pick_groups, preference_pairs
from rldock.runtime.tasks import PreferencePair


class CharTokenizer:
    """Test double for the tiny tokenizer: one token per character, digits 0-9 -> ids 3-12."""

    pad_token_id, eos_token_id = 0, 1

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[3 + "0123456789+=".index(c) for c in t] for t in texts]}


class PairTask:
    """Test double: fixed preference pairs by index."""

    def preference_pairs(self, indices):
        table = {0: PreferencePair("1+2=", "3", "4"), 1: PreferencePair("5+5=", "10", "16")}
        return [table[i] for i in indices]


def _algo(**kw):
    base = dict(name="dpo", num_prompts_per_iteration=2, num_responses_per_prompt=2, max_prompt_length=5,
                max_response_length=4, learning_rate=0.0)
    return AlgorithmSpec(**{**base, **kw})


def test_preference_pairs_are_chosen_then_rejected_with_eos():
    fed = preference_pairs(PairTask(), [1, 0], CharTokenizer(), _algo())
    b = fed.batch
    assert b.batch_size == torch.Size([4])
    # rows: 5+5= chosen "10", rejected "16"; 1+2= chosen "3", rejected "4"; EOS (1) after the answer
    assert b["response_ids"].tolist() == [[4, 3, 1, 0], [4, 9, 1, 0], [6, 1, 0, 0], [7, 1, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert torch.equal(b["prompt_ids"][0], b["prompt_ids"][1]) and torch.equal(b["prompt_ids"][2], b["prompt_ids"][3])
    assert fed.prompt_lengths == [4, 4] and fed.response_lengths == [3, 3, 2, 2]


def test_merge_rounds_sums_numbers_and_joins_lists_per_worker():
    rounds = [[{"compute_s": 1.0, "rewards": [1]}, {"compute_s": 2.0, "rewards": [2]}],
              [{"compute_s": 0.5, "rewards": [3]}, {"compute_s": 0.25, "rewards": []}]]
    assert merge_rounds(rounds) == [{"compute_s": 1.5, "rewards": [1, 3]}, {"compute_s": 2.25, "rewards": [2]}]


def test_pick_groups_keeps_whole_groups_in_order():
    batch = TensorDict({"x": torch.arange(6)}, batch_size=[6])
    assert pick_groups(batch, torch.tensor([True, False, True]), group_size=2)["x"].tolist() == [0, 1, 4, 5]


def _rounds(reward_rounds, *, num_groups=2, max_rounds=3):
    """Run DynamicSampling over scripted per-round rewards (groups of 2); returns the result and
    the rounds' first sample ids (id = 100 * round + row)."""
    calls = []

    def draw():
        return DriverBatch(TensorDict({"prompt_mask": torch.ones(4, 3)}, batch_size=[4]), [3, 3])

    def run_round(fed, sampling_round):
        calls.append(sampling_round)
        scored = fed.batch.clone()
        scored["reward"] = torch.tensor(reward_rounds[sampling_round])
        scored["id"] = torch.arange(4) + 100 * sampling_round
        return {"reward": [{"compute_s": 1.0, "rewards": reward_rounds[sampling_round]}]}, scored

    sampler = DynamicSampling(num_groups=num_groups, group_size=2, max_rounds=max_rounds,
                              group_filter=informative_groups)
    return sampler.run(draw, run_round), calls


def test_dynamic_sampling_refills_until_enough_groups_differ():
    # round 0 keeps group 1 only, round 1 keeps group 0: two groups, so a third round never runs
    out, calls = _rounds([[1.0, 1.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    assert calls == [0, 1]
    assert out.batch.batch["id"].tolist() == [2, 3, 100, 101]
    assert out.metrics == {"dynamic_sampling/rounds": 2, "dynamic_sampling/kept_groups": 2,
                           "dynamic_sampling/padded_groups": 0}
    assert out.results["reward"] == [{"compute_s": 2.0, "rewards": [1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.0, 0.0]}]
    assert out.batch.prompt_lengths == [3, 3]


def test_dynamic_sampling_drops_surplus_groups():
    out, calls = _rounds([[0.0, 1.0, 1.0, 0.0]], num_groups=1)
    assert calls == [0] and out.batch.batch["id"].tolist() == [0, 1]
    assert out.metrics["dynamic_sampling/kept_groups"] == 2


def test_dynamic_sampling_pads_with_dropped_groups_after_the_last_round():
    out, calls = _rounds([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.5, 0.5]], max_rounds=2)
    assert calls == [0, 1]
    # kept: round 1 group 0; padding: the first dropped group (round 0 group 0)
    assert out.batch.batch["id"].tolist() == [100, 101, 0, 1]
    assert out.metrics["dynamic_sampling/padded_groups"] == 1


@pytest.mark.parametrize("name, expected", [("grpo", ()), ("dapo", ("rollout", "reward", "sample_filter"))])
def test_recipes_split_sampling_states_from_the_rest(name, expected):
    from rldock.runtime.algorithms.recipes import get_recipe

    recipe = get_recipe(name)
    skipped = tuple(s for s in recipe.consumes if s not in recipe.launched_states)
    assert skipped == expected


def test_dpo_recipe_runs_no_rollout():
    from rldock.runtime.algorithms.recipes import get_recipe

    recipe = get_recipe("dpo")
    assert recipe.launched_states == ("reference", "preference_update")
    assert not recipe.needs_rollout_engine


def test_dapo_reward_shaping_and_loss_kwargs_follow_the_spec():
    from rldock.runtime.algorithms.recipes import get_recipe

    recipe = get_recipe("dapo")
    algo = _algo(name="dapo", max_response_length=6, dapo={"overlong_buffer_length": 2,
                                                          "overlong_penalty_factor": 0.5})
    shaped = recipe.reward_shaping(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([3, 5, 6]), algo)
    assert torch.allclose(shaped, torch.tensor([1.0, 0.75, -0.5]))
    assert recipe.policy_loss_kwargs(algo) == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}
    off = _algo(name="dapo", dapo={"dynamic_sampling": False})
    assert recipe.sampling_rounds.group_filter(off)(torch.ones(4), 2).tolist() == [True, True]
