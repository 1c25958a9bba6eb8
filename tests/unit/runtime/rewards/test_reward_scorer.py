"""RewardScorer: weighted sums of terms, per-term metrics, on_error, and the merge of metrics over batches."""

import logging
import math

import pytest
import ray
import torch

from rldock.config import RewardSpec
from rldock.runtime.cli.job_commands import reward_failure
from rldock.runtime.rewards import RewardError, RewardMetrics, RewardScorer, merge_reward_metrics

GOLD = "#### 42"


def _score(spec: dict, responses: list[str], ground_truths: list[str] | None = None, data_sources=None):
    num = len(responses)
    return RewardScorer(RewardSpec(**spec)).score(
        responses, ground_truths or [GOLD] * num, data_sources or ["gsm8k"] * num, [{}] * num
    )


def test_the_reward_is_the_weighted_sum_of_the_terms():
    spec = {
        "terms": [
            {"name": "math_verify"},
            {"name": "format", "pattern": r".*####\s*\d+", "weight": 0.5},
            {"name": "exact_match", "weight": -2.0},
        ]
    }
    scored = _score(spec, ["so #### 42", "The answer is 42", "#### 41"], ["#### 42", "#### 42", "#### 41"])
    assert scored.scores.dtype == torch.float32 and scored.scores.shape == (3,)
    assert scored.term_scores["math_verify"].tolist() == [1.0, 1.0, 1.0]
    assert scored.term_scores["format"].tolist() == [1.0, 0.0, 1.0]
    assert scored.term_scores["exact_match"].tolist() == [0.0, 0.0, 1.0]
    assert scored.scores.tolist() == [1.5, 1.0, -0.5]
    assert scored.metrics == pytest.approx(
        {"reward/math_verify": 1.0, "reward/format": 2 / 3, "reward/exact_match": 1 / 3, "reward/errors": 0.0}
    )


def test_a_name_used_twice_gets_the_term_index_in_its_metric():
    spec = {
        "terms": [{"name": "format", "pattern": r"\d+"}, {"name": "digit_match"}, {"name": "format", "pattern": r".*2"}]
    }
    scored = _score(spec, ["42"], ["42"])
    assert set(scored.metrics) == {"reward/format_0", "reward/digit_match", "reward/format_2", "reward/errors"}
    assert scored.scores.tolist() == [3.0]


def test_the_default_digit_match_term_keeps_the_old_numbers():
    scored = _score({}, ["85", "95", "15"], ["95", "95", "105"])
    assert scored.scores.tolist() == pytest.approx([0.5, 1.0, 1 / 3])


def test_on_error_fail_raises_naming_the_term_and_the_data_source_with_the_cause():
    with pytest.raises(
        RewardError,
        match=r"reward.terms\[1\] \(math_verify\) failed on a sample from data_source "
        r"'aime': ValueError: math_verify cannot parse the ground truth 'unknown'",
    ) as caught:
        _score(
            {"terms": [{"name": "digit_match"}, {"name": "math_verify"}]},
            ["1", "2"],
            ["1", "unknown"],
            ["gsm8k", "aime"],
        )
    assert isinstance(caught.value.__cause__, ValueError)


def test_on_error_zero_scores_the_term_zero_counts_it_and_warns_once_per_batch(caplog):
    spec = {"terms": [{"name": "digit_match", "weight": 0.5}, {"name": "math_verify"}], "on_error": "zero"}
    with caplog.at_level(logging.WARNING, logger="rldock.runtime.rewards.scorer"):
        scored = _score(spec, ["42", "42", "42"], ["42", "unknown", "oops"])
    assert scored.scores.tolist() == [1.5, 0.0, 0.0]
    assert scored.term_scores["math_verify"].tolist() == [1.0, 0.0, 0.0]
    assert scored.metrics["reward/errors"] == 2.0
    (warning,) = caplog.records
    assert "reward.terms[1] (math_verify) raised on 2 of 3 samples" in warning.getMessage()


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        RewardScorer(RewardSpec()).score(["1", "2"], ["1"], ["", ""], [{}, {}])


def test_metrics_merge_over_batches_weighted_by_samples_and_sum_the_errors():
    spec = RewardSpec(terms=[{"name": "digit_match"}, {"name": "math_verify"}], on_error="zero")
    scorer = RewardScorer(spec)
    first, second = RewardMetrics(), RewardMetrics()
    first.add(scorer.score(["1", "2", "3"], ["1", "1", "no answer"], ["", "", ""], [{}] * 3))  # math_verify: 1 error
    second.add(scorer.score(["1"], ["1"], [""], [{}]))
    merged = merge_reward_metrics([first.state(), second.state()])
    assert merged == pytest.approx({"reward/digit_match": 2 / 4, "reward/math_verify": 2 / 4, "reward/errors": 1})
    assert merge_reward_metrics([]) == {}


def test_nan_is_not_a_score():
    class Nan:  # test double of a numpy scalar that is NaN
        ndim = 0

        def item(self):
            return math.nan

        def __float__(self):
            return math.nan

    from rldock.runtime.rewards.scorer import _number

    assert _number(Nan()) is None and _number(float("inf")) is None and _number(True) == 1.0


def test_the_cli_reports_a_reward_failure_from_a_worker_by_its_message():
    # What ray.get raises when the reward worker raised: an instance of both RayTaskError and the cause.
    cause = RewardError("reward.terms[0] (math_verify) failed on a sample from data_source 'gsm8k': ...")
    wrapped = ray.exceptions.RayTaskError("compute_rewards", "Traceback ...", cause).as_instanceof_cause()
    assert isinstance(wrapped, RewardError)
    assert reward_failure(wrapped) == str(cause)
    assert reward_failure(cause) == str(cause)


def test_precomputed_scores_stand_for_their_term_weighted_and_reported():
    spec = {"terms": [{"name": "model", "path": "/rm", "weight": 0.5}, {"name": "exact_match"}]}
    scorer = RewardScorer(RewardSpec(**spec))
    scored = scorer.score(
        ["42", "41"],
        ["42", "42"],
        ["d", "d"],
        [{}, {}],
        precomputed={0: torch.tensor([2.0, -4.0], dtype=torch.float64)},
    )
    assert scored.term_scores["model"].dtype == torch.float32
    assert scored.term_scores["model"].tolist() == [2.0, -4.0]
    assert scored.scores.tolist() == [2.0, -2.0]  # 0.5 * model + exact_match
    assert scored.metrics["reward/model"] == -1.0


def test_a_model_term_without_its_precomputed_scores_says_where_they_come_from():
    scorer = RewardScorer(RewardSpec(terms=[{"name": "model", "path": "/rm"}]))
    with pytest.raises(RewardError, match=r"reward.terms\[0\] \(model /rm\) has no precomputed scores.*reward_model"):
        scorer.score(["42"], ["42"], ["d"], [{}])


@pytest.mark.parametrize(
    "precomputed, words",
    [
        ({0: torch.tensor([1.0, 2.0])}, "shape (2,) for 1 samples"),
        ({0: torch.tensor([math.nan])}, "non-finite"),
    ],
)
def test_precomputed_scores_of_the_wrong_shape_or_not_finite_are_refused(precomputed, words):
    scorer = RewardScorer(RewardSpec(terms=[{"name": "model", "path": "/rm"}]))
    with pytest.raises(RewardError) as caught:
        scorer.score(["42"], ["42"], ["d"], [{}], precomputed=precomputed)
    assert words in str(caught.value)
