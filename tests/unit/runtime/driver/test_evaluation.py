"""Held-out evaluation: the pure aggregation per data source, the prompt split over engines, and
scoring of generated token ids (no Ray, no engine: `Evaluator.score` is what `run` calls)."""

from __future__ import annotations

import pytest

from rldock.config.job import EvaluationSpec
from rldock.runtime.driver.evaluation import EvalExample, Evaluator, aggregate, split_evenly, val_metrics
from rldock.runtime.models.tiny import train_char_tokenizer


def test_aggregate_means_and_accuracy_per_data_source():
    metrics = aggregate(
        data_sources=["gsm8k", "gsm8k", "math", "gsm8k"],
        rewards=[1.0, 0.0, 0.5, 1.0],
        response_lengths=[4, 6, 10, 4],
        num_prompts=3,
        correct_threshold=1.0,
    )
    assert metrics == pytest.approx(
        {
            "val/gsm8k/reward": 2 / 3,
            "val/gsm8k/accuracy": 2 / 3,
            "val/math/reward": 0.5,
            "val/math/accuracy": 0.0,
            "val/reward": 2.5 / 4,
            "val/accuracy": 0.5,
            "val/response_length": 6.0,
            "val/num_prompts": 3.0,
        }
    )


def test_correct_threshold_counts_rewards_at_or_above_it():
    metrics = aggregate(
        data_sources=["a"] * 4,
        rewards=[0.2, 0.5, 0.7, 1.0],
        response_lengths=[1] * 4,
        num_prompts=4,
        correct_threshold=0.5,
    )
    assert metrics["val/accuracy"] == metrics["val/a/accuracy"] == 0.75


@pytest.mark.parametrize(
    "kwargs, complaint",
    [
        ({"data_sources": ["a"], "rewards": [1.0, 0.0], "response_lengths": [1]}, "one of each per response"),
        ({"data_sources": [], "rewards": [], "response_lengths": []}, "held-out set is empty"),
    ],
)
def test_aggregate_refuses_misaligned_or_empty_input(kwargs, complaint):
    with pytest.raises(ValueError, match=complaint):
        aggregate(**kwargs, num_prompts=1, correct_threshold=1.0)


@pytest.mark.parametrize(
    "count, parts, sizes", [(10, 3, [4, 3, 3]), (2, 4, [1, 1, 0, 0]), (8, 2, [4, 4]), (0, 2, [0, 0])]
)
def test_split_evenly_covers_every_prompt_once_in_order(count, parts, sizes):
    chunks = split_evenly(count, parts)
    assert [len(c) for c in chunks] == sizes
    assert [i for c in chunks for i in c] == list(range(count))


@pytest.fixture(scope="module")
def tokenizer():
    return train_char_tokenizer(["0123456789+="])


def _evaluator(tokenizer, **spec) -> Evaluator:
    examples = [
        EvalExample("1+2=", "3", "addition"),
        EvalExample("4+4=", "8", "addition"),
        EvalExample("9+9=", "18", "carry"),
    ]

    def exact(responses, scored):
        return [float(r == e.ground_truth) for r, e in zip(responses, scored)]

    prompt_ids = [tokenizer(e.prompt)["input_ids"] for e in examples]  # with BOS, as train prompts
    return Evaluator(
        examples,
        exact,
        prompt_ids=prompt_ids,
        tokenizer=tokenizer,
        spec=EvaluationSpec(interval=1, **spec),
        max_response_length=4,
    )


def test_score_decodes_up_to_eos_and_groups_by_data_source(tokenizer):
    evaluator = _evaluator(tokenizer)
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    # right; right then EOS and junk after it (never read); wrong, cut at max length
    metrics = evaluator.score([[ids("3") + [eos]], [ids("8") + [eos] + ids("1")], [ids("1999")]])
    assert metrics["val/addition/accuracy"] == 1.0 and metrics["val/carry/accuracy"] == 0.0
    assert metrics["val/accuracy"] == pytest.approx(2 / 3)
    assert metrics["val/response_length"] == pytest.approx((2 + 3 + 4) / 3)
    assert metrics["val/num_prompts"] == 3


def test_max_prompts_keeps_the_first_prompts_and_samples_count_per_response(tokenizer):
    evaluator = _evaluator(tokenizer, max_prompts=2, num_samples=2, greedy=False)
    assert len(evaluator.prompts) == 2
    assert evaluator.prompts[0][0] == tokenizer.bos_token_id  # encoded as training prompts are
    eos = tokenizer.eos_token_id
    three = tokenizer("3", add_special_tokens=False)["input_ids"]
    metrics = evaluator.score([[three + [eos], [eos]], [[eos], [eos]]])
    assert metrics["val/accuracy"] == 0.25 and metrics["val/num_prompts"] == 2
    with pytest.raises(ValueError, match="responses for 3 prompts, but 2"):
        evaluator.score([[[eos]]] * 3)


def test_every_held_out_example_needs_its_prompt_ids(tokenizer):
    with pytest.raises(ValueError, match="1 tokenized prompts for 2 held-out examples"):
        Evaluator(
            [EvalExample("1+2=", "3", "addition"), EvalExample("4+4=", "8", "addition")],
            lambda r, e: [0.0] * len(r),
            prompt_ids=[[1, 2]],
            tokenizer=tokenizer,
            spec=EvaluationSpec(interval=1),
            max_response_length=4,
        )


def test_val_metrics_picks_the_val_keys_of_a_record():
    assert val_metrics({"iteration": 3, "reward_mean": 0.5, "val/reward": 0.25}) == {"val/reward": 0.25}
    assert val_metrics({"iteration": 2, "reward_mean": 0.5}) == {}


def test_the_trainers_held_out_set_is_the_val_files_scored_by_the_jobs_reward(tokenizer, tmp_path):
    import json

    from rldock.config import parse_job_config
    from rldock.runtime.driver.inputs import heldout_evaluation

    val = tmp_path / "val.jsonl"
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(6)] + [
        {"prompt": "12345678+1=", "answer": "0"}
    ]
    val.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = {
        "iterations": 10,
        "model": {"path": "/unused"},
        "data": {"train_files": [str(val)], "val_files": [str(val)], "chat_template": "none"},
        "reward": {"terms": [{"name": "exact_match"}]},
        "algorithm": {
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 8,
            "max_response_length": 4,
            "learning_rate": 0.0,
        },
    }
    evaluation_off = {**data, "data": {"train_files": [str(val)], "chat_template": "none"}}
    assert heldout_evaluation(parse_job_config(evaluation_off), tokenizer, [str(val)]) is None
    evaluator = heldout_evaluation(
        parse_job_config({**data, "evaluation": {"interval": 1, "max_prompts": 5}}), tokenizer, [str(val)]
    )
    # the first 5 of the 6 prompts that fit algorithm.max_prompt_length (the long one is dropped, as in training)
    assert [e.prompt for e in evaluator.examples] == [f"{a}+{a}=" for a in range(5)]
    assert {e.data_source for e in evaluator.examples} == {"val"}  # the file's stem
    assert evaluator.prompts[0] == tokenizer("0+0=")["input_ids"]  # BOS + prompt, as train prompts
    eos = tokenizer.eos_token_id
    answers = [tokenizer(e.ground_truth, add_special_tokens=False)["input_ids"] + [eos] for e in evaluator.examples]
    assert evaluator.score([[a] for a in answers])["val/val/accuracy"] == 1.0
    assert evaluator.score([[[eos]]] * 5)["val/accuracy"] == 0.0


def test_held_out_responses_are_scored_without_the_reward_model_term(tokenizer, tmp_path):
    import json

    from rldock.config import parse_job_config
    from rldock.runtime.driver.inputs import heldout_evaluation

    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(3)))
    cfg = parse_job_config(
        {
            "iterations": 10,
            "model": {"path": "/unused"},
            "evaluation": {"interval": 1},
            "data": {"train_files": [str(val)], "val_files": [str(val)], "chat_template": "none"},
            "reward": {"terms": [{"name": "model", "path": "/no/reward/model"}, {"name": "exact_match", "weight": 2}]},
            "algorithm": {
                "num_prompts_per_iteration": 2,
                "num_responses_per_prompt": 2,
                "max_prompt_length": 8,
                "max_response_length": 4,
                "learning_rate": 0.0,
            },
        }
    )
    evaluator = heldout_evaluation(cfg, tokenizer, [str(val)])
    eos = tokenizer.eos_token_id
    answers = [tokenizer(e.ground_truth, add_special_tokens=False)["input_ids"] + [eos] for e in evaluator.examples]
    assert evaluator.score([[a] for a in answers])["val/reward"] == 2.0  # exact_match only, weighted


def test_a_held_out_request_carries_each_prompts_task_for_a_harness(tokenizer):
    messages = [{"role": "user", "content": "1+2="}]
    examples = [
        EvalExample("<rendered>", "3", "addition", {"id": 7}, row_prompt=messages),
        EvalExample("4+4=", "8", "carry"),
    ]
    evaluator = Evaluator(
        examples,
        lambda r, e: [0.0] * len(r),
        prompt_ids=[[1, 2], [3, 4]],
        tokenizer=tokenizer,
        spec=EvaluationSpec(interval=1),
        max_response_length=4,
    )
    request = evaluator.request([1, 0], iteration=3)
    assert request.prompts == [[3, 4], [1, 2]] and request.greedy and request.seed == 3
    # the prompt as the row stored it (a harness gets messages, not the rendered text), and its place in the set
    assert request.tasks == [
        {"prompt": "4+4=", "ground_truth": "8", "data_source": "carry", "extra_info": {}, "prompt_index": 1},
        {
            "prompt": messages,
            "ground_truth": "3",
            "data_source": "addition",
            "extra_info": {"id": 7},
            "prompt_index": 0,
        },
    ]
