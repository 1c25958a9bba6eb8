"""Driver batches (prompt groups, preference pairs) and DAPO's dynamic sampling rounds."""

import pytest
import torch
from tensordict import TensorDict

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime.algorithms.dapo import informative_groups
from rldock.runtime.data import PreferencePair, Row
from rldock.runtime.data.row_column import row_bytes, rows_from_column
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.feed import (
    DriverBatch,
    DynamicSampling,
    SampleFacts,
    group_rows,
    merge_rounds,
    preference_pairs,
    prompt_groups,
)


class CharTokenizer:
    """Test double for the tiny tokenizer: one token per character, digits 0-9 -> ids 3-12."""

    pad_token_id, eos_token_id = 0, 1

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[3 + "0123456789+=".index(c) for c in t] for t in texts]}


class TwoPromptDataset:
    """Test double of PromptDataset: kept prompts "1+2=" (train row 7) and "5+5=" (row 9), as BOS (2)
    + characters, with fixed preference pairs."""

    prompts = {0: [2, 4, 13, 5, 14], 1: [2, 8, 13, 8, 14]}
    rows = {0: 7, 1: 9}
    train_rows = {0: Row("1+2=", "3", "addition", line=7), 1: Row("5+5=", "10", "addition", {"level": 2}, line=9)}
    row_width = 512  # more than either row pickled

    def prompt_ids(self, positions):
        return [self.prompts[p] for p in positions]

    def prompt_index(self, position):
        return self.rows[position]

    def encoded_rows(self, positions):
        return [row_bytes(self.train_rows[p]) for p in positions]

    def preference_pairs(self, positions):
        table = {0: PreferencePair(7, "3", "4"), 1: PreferencePair(9, "10", "16")}
        return [table[p] for p in positions]


def _algo(**kw):
    base = dict(
        name="dpo",
        num_prompts_per_iteration=2,
        num_responses_per_prompt=2,
        max_prompt_length=5,
        max_response_length=4,
        learning_rate=0.0,
    )
    return AlgorithmSpec(**{**base, **kw})


def test_preference_pairs_are_chosen_then_rejected_with_eos():
    fed = preference_pairs(TwoPromptDataset(), [1, 0], CharTokenizer(), _algo())
    b = fed.batch
    assert b.batch_size == torch.Size([4])
    # rows: 5+5= chosen "10", rejected "16"; 1+2= chosen "3", rejected "4"; EOS (1) after the answer
    assert b["response_ids"].tolist() == [[4, 3, 1, 0], [4, 9, 1, 0], [6, 1, 0, 0], [7, 1, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0]]
    assert torch.equal(b["prompt_ids"][0], b["prompt_ids"][1]) and torch.equal(b["prompt_ids"][2], b["prompt_ids"][3])
    assert fed.prompt_lengths == [5, 5] and b["response_length"].tolist() == [3, 3, 2, 2]  # the answer and EOS


def test_prompt_groups_carry_each_prompts_train_row_by_number_and_whole():
    dataset = TwoPromptDataset()
    fed = prompt_groups(
        dataset, [1, 0], CharTokenizer(), _algo(name="grpo", num_responses_per_prompt=3, max_prompt_length=6)
    )
    b = fed.batch
    assert set(b.keys()) == {"prompt_ids", "prompt_mask", "prompt_index", "prompt_row"}
    assert b["prompt_index"].dtype == torch.int64 and b["prompt_index"].tolist() == [9, 9, 9, 7, 7, 7]  # (G*N,)
    # the row itself, which the reward and an environment read: (G*N, W) uint8, W the dataset's
    assert b["prompt_row"].dtype == torch.uint8 and b["prompt_row"].shape == (6, dataset.row_width)
    assert rows_from_column(b["prompt_row"]) == [dataset.train_rows[1]] * 3 + [dataset.train_rows[0]] * 3
    assert b["prompt_ids"][0].tolist() == [0, 2, 8, 13, 8, 14]  # left-padded to PL
    assert b["prompt_mask"][3].tolist() == [0, 1, 1, 1, 1, 1]
    assert fed.prompt_lengths == [5, 5]


def test_merge_rounds_sums_numbers_and_joins_lists_per_worker():
    rounds = [
        [
            StageResult(compute_s=1.0, num_samples=2, metrics={"ids": [1]}),
            StageResult(compute_s=2.0, metrics={"ids": [2]}),
        ],
        [
            StageResult(compute_s=0.5, num_samples=2, metrics={"ids": [3]}),
            StageResult(compute_s=0.25, metrics={"ids": []}),
        ],
    ]
    assert merge_rounds(rounds) == [
        StageResult(compute_s=1.5, num_samples=4, metrics={"ids": [1, 3]}),
        StageResult(compute_s=2.25, metrics={"ids": [2]}),
    ]


def test_merge_rounds_merges_the_reward_workers_metric_states_key_by_key():
    """DAPO's reward worker returns its metric sums and counts each round; the rounds' are summed."""
    first = StageResult().with_metrics(
        reward_metrics={"sums": {"reward/model": 1.5}, "counts": {"reward/model": 2}, "errors": 0}
    )
    second = StageResult().with_metrics(
        reward_metrics={
            "sums": {"reward/model": 0.5, "reward/x/y": 1.0},
            "counts": {"reward/model": 2, "reward/x/y": 1},
            "errors": 1,
        }
    )
    assert merge_rounds([[first], [second]]) == [
        StageResult().with_metrics(
            reward_metrics={
                "sums": {"reward/model": 2.0, "reward/x/y": 1.0},
                "counts": {"reward/model": 4, "reward/x/y": 1},
                "errors": 1,
            }
        )
    ]
    assert first.metrics["reward_metrics"]["sums"] == {"reward/model": 1.5}  # the inputs are left as they were


def test_group_rows_are_the_samples_of_each_group_slot():
    assert group_rows(torch.tensor([0, 2]), 3).tolist() == [0, 1, 2, 6, 7, 8]


class SlotDock:
    """Test double of the dock's group slots: what each slot holds, and every empty/put/score step."""

    def __init__(self, scores_by_round, group_size=2):
        self.scores_by_round, self.group_size = scores_by_round, group_size
        self.rows: dict[int, int] = {}  # dock row -> id of the sample there
        self.log: list[tuple] = []
        self.drawn = 0

    def draw(self, num_prompts):
        ids = torch.arange(self.drawn, self.drawn + num_prompts).repeat_interleave(self.group_size)
        self.drawn += num_prompts
        return DriverBatch(
            TensorDict({"id": ids, "prompt_mask": torch.ones(len(ids), 3)}, batch_size=[len(ids)]),
            [3 + i for i in range(num_prompts)],
        )

    def run_round(self, groups, fresh, sampling_round):
        rows = group_rows(groups, self.group_size)
        self.log.append(("empty+put", sampling_round, groups.tolist()))
        self.rows.update(zip(rows.tolist(), fresh.batch["id"].tolist()))
        scores = self.scores_by_round[sampling_round]  # per group this round, expanded to its rows
        rewards = [x for score in scores for x in score]
        return {"reward": [StageResult(compute_s=1.0, num_samples=len(rewards))]}, torch.tensor(rewards)

    def run(self, *, num_groups=2, max_rounds=3):
        sampler = DynamicSampling(
            num_groups=num_groups, group_size=self.group_size, max_rounds=max_rounds, group_filter=informative_groups
        )
        return sampler.run(self.draw, self.run_round)


def test_dynamic_sampling_refills_only_the_slots_of_dropped_groups():
    # round 0: prompt 0 (slot 0) all equal -> dropped, prompt 1 (slot 1) kept; round 1 refills
    # slot 0 only, with prompt 2, which differs -> kept; no third round
    dock = SlotDock([[(1.0, 1.0), (0.0, 1.0)], [(0.0, 0.5)], [(0.0, 1.0)]])
    out = dock.run()
    assert dock.log == [("empty+put", 0, [0, 1]), ("empty+put", 1, [0])]
    assert dock.rows == {0: 2, 1: 2, 2: 1, 3: 1}  # the kept prompt 1 never moved
    assert out.batch.batch["id"].tolist() == [2, 2, 1, 1]  # the driver's copy agrees with the dock
    assert out.batch.prompt_lengths == [3, 4]
    assert out.metrics == {
        "dynamic_sampling/rounds": 2,
        "dynamic_sampling/kept_groups": 2,
        "dynamic_sampling/padded_groups": 0,
    }
    assert out.results["reward"] == [StageResult(compute_s=2.0, num_samples=6)]  # both rounds' samples


def test_dynamic_sampling_pads_with_the_last_rounds_dropped_groups():
    dock = SlotDock([[(1.0, 1.0), (0.0, 0.0)], [(0.0, 1.0), (0.5, 0.5)]])
    out = dock.run(max_rounds=2)
    assert dock.log == [("empty+put", 0, [0, 1]), ("empty+put", 1, [0, 1])]
    assert out.batch.batch["id"].tolist() == [2, 2, 3, 3]  # slot 1 holds round 1's dropped prompt 3
    assert out.metrics["dynamic_sampling/padded_groups"] == 1
    assert out.metrics["dynamic_sampling/kept_groups"] == 1


def test_dapo_filters_groups_on_the_unshaped_score():
    """A group of equally correct answers, one of them overlong: its shaped rewards differ, its
    scores do not, so the paper's filter (on accuracy) drops it."""
    from rldock.runtime.flow.catalogue import get_recipe

    recipe = get_recipe("dapo")
    algo = _algo(name="dapo", max_response_length=6, dapo={"overlong_buffer_length": 2})
    score = torch.tensor([1.0, 1.0, 0.0, 1.0])  # (B,) groups of 2
    shaped = recipe.reward_shaping(score, torch.tensor([3, 6, 3, 3]), algo)
    assert shaped.tolist() == [1.0, 0.0, 0.0, 1.0]
    rounds = recipe.sampling_rounds
    assert rounds.score_column == "score"
    assert recipe.consumes[rounds.read_state] == ("score", "response_length", "prompt_draw")
    assert "score" in recipe.produces["reward"]
    assert rounds.group_filter(algo)(score, 2).tolist() == [False, True]


@pytest.mark.parametrize(
    "name, expected", [("grpo", ("sample_facts",)), ("dapo", ("rollout", "reward", "sample_facts"))]
)
def test_recipes_split_sampling_states_from_the_rest(name, expected):
    from rldock.runtime.flow.catalogue import get_recipe

    recipe = get_recipe(name)
    skipped = tuple(s for s in recipe.consumes if s not in recipe.launched_states)
    assert skipped == expected


def test_dpo_recipe_runs_no_rollout():
    from rldock.runtime.flow.catalogue import get_recipe

    recipe = get_recipe("dpo")
    assert recipe.launched_states == ("reference", "preference_update")
    assert not recipe.needs_rollout_engine


def test_dapo_reward_shaping_and_loss_kwargs_follow_the_spec():
    from rldock.runtime.flow.catalogue import get_recipe

    recipe = get_recipe("dapo")
    algo = _algo(name="dapo", max_response_length=6, dapo={"overlong_buffer_length": 2, "overlong_penalty_factor": 0.5})
    shaped = recipe.reward_shaping(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([3, 5, 6]), algo)
    assert torch.allclose(shaped, torch.tensor([1.0, 0.75, -0.5]))
    assert recipe.policy_loss_kwargs(algo) == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    off = _algo(name="dapo", dapo={"dynamic_sampling": False})
    assert recipe.sampling_rounds.group_filter(off)(torch.ones(4), 2).tolist() == [True, True]


def test_the_facts_count_an_episode_of_several_rows_once():
    """A harness's episode of three rows (two segments, one empty row) is one reward in reward_mean; its
    segments' lengths count, its empty row's does not."""
    facts = SampleFacts()
    facts.add(
        TensorDict(
            {
                "score": torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]),
                "response_length": torch.tensor([5, 7, 0, 4, 0, 0]),
                "episode": torch.tensor([0, 0, 0, 1, 1, 1]),
                "prompt_draw": torch.tensor([4, 4, 4, 4, 4, 4]),
            },
            batch_size=[6],
        )
    )
    assert facts.scores == [1.0, 0.0] and facts.response_lengths == [5, 7, 4]
    assert facts.draws == {4}  # the group both episodes belong to


def test_dynamic_sampling_filters_episodes_of_a_group_of_segment_rows():
    """Groups of 2 episodes x 2 rows: the filter sees each episode's score once (run_round's), the slots
    their 4 rows."""
    dock = SlotDock([[(1.0, 1.0), (0.0, 1.0)], [(0.0, 1.0)]], group_size=4)  # scores per episode, 4 rows a slot
    sampler = DynamicSampling(
        num_groups=2, group_size=4, episodes_per_group=2, max_rounds=3, group_filter=informative_groups
    )
    out = sampler.run(dock.draw, dock.run_round)
    assert dock.log == [("empty+put", 0, [0, 1]), ("empty+put", 1, [0])]
    assert out.metrics["dynamic_sampling/kept_groups"] == 2
