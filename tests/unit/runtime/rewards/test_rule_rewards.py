"""Tests of the string rule rewards: exact_match, digit_match (the tiny demo learns on it, so its
numbers must not move) and format."""

import pytest

from rldock.config import RewardTermSpec
from rldock.runtime.rewards import REWARDS, RewardBatch
from rldock.runtime.rewards.rules import digit_match, exact_match


def _score(name: str, response: str, answer: str, **options) -> float:
    (value,) = REWARDS.get(name)(RewardTermSpec(name=name, **options), "reward.terms[0]")(
        RewardBatch([""], [response], [answer], [{}])
    )
    return value


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("95", "95", 1.0),
        (" 95 ", "95", 1.0),
        ("96", "95", 0.0),
        ("", "95", 0.0),
        ("950", "95", 0.0),
    ],
)
def test_exact_match(response, answer, expected):
    assert exact_match("", response, answer, {}) == expected
    assert _score("exact_match", response, answer) == expected


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("95", "95", 1.0),
        (" 95\n", "95", 1.0),
        ("85", "95", 0.5),  # units right
        ("94", "95", 0.5),  # tens right
        ("15", "105", 1 / 3),  # aligned by place value: units right, wrong length
        ("105", "15", 1 / 3),
        ("950", "95", 0.0),  # shifted digits are not in place
        ("5", "95", 0.5),  # missing digit costs its share
        ("", "95", 0.0),
        ("+=", "7", 0.0),
        ("7", "7", 1.0),
        ("1+7", "7", 1 / 3),
    ],
)
def test_digit_match(response, answer, expected):
    assert digit_match("", response, answer, {}) == pytest.approx(expected)
    assert _score("digit_match", response, answer) == pytest.approx(expected)


def test_only_the_exact_answer_scores_one_under_digit_match():
    for response in ["1234", "23", "123 ", "0123", "1230", "12"]:
        assert digit_match("", response, "123", {}) < 1.0 or response.strip() == "123"


@pytest.mark.parametrize("fn", [exact_match, digit_match])
def test_rule_rewards_are_in_unit_interval(fn):
    for response, answer in [("1", "22"), ("999999", "1"), ("abc", "12"), ("12", "12")]:
        assert 0.0 <= fn("", response, answer, {}) <= 1.0


@pytest.mark.parametrize(
    "pattern, response, expected",
    [
        (r"\d+", "42", 1.0),
        (r"\d+", " 42\n", 1.0),  # surrounding whitespace is removed first
        (r"\d+", "x42", 0.0),  # the whole response must match, not a part
        (r".*####\s*\d+", "so 6*7 = 42\n#### 42", 1.0),  # `.` spans lines
        (r"<think>.*</think>\s*<answer>.*</answer>", "<think>6*7</think>\n<answer>42</answer>", 1.0),
        (r"<think>.*</think>\s*<answer>.*</answer>", "<answer>42</answer>", 0.0),
        (r".*boxed.*", "the answer is \\boxed{42}.", 1.0),
    ],
)
def test_format_matches_the_whole_response(pattern, response, expected):
    assert _score("format", response, "", pattern=pattern) == expected


def test_unknown_reward_lists_valid_names():
    with pytest.raises(ValueError, match=r"reward.terms.name 'nope'.*digit_match.*exact_match"):
        REWARDS.get("nope")
