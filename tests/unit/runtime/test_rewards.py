"""Tests of the rule rewards."""

import pytest

from rldock.runtime.rewards import REWARDS, get_reward_fn


@pytest.mark.parametrize("response, answer, expected", [
    ("95", "95", 1.0),
    (" 95 ", "95", 1.0),
    ("96", "95", 0.0),
    ("", "95", 0.0),
    ("950", "95", 0.0),
])
def test_exact_match(response, answer, expected):
    assert get_reward_fn("exact_match")(response, answer) == expected


@pytest.mark.parametrize("response, answer, expected", [
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
])
def test_digit_match(response, answer, expected):
    assert get_reward_fn("digit_match")(response, answer) == pytest.approx(expected)


def test_only_the_exact_answer_scores_one_under_digit_match():
    fn = get_reward_fn("digit_match")
    for response in ["1234", "23", "123 ", "0123", "1230", "12"]:
        assert fn(response, "123") < 1.0 or response.strip() == "123"


def test_rewards_are_in_unit_interval():
    for fn in REWARDS.values():
        for response, answer in [("1", "22"), ("999999", "1"), ("abc", "12"), ("12", "12")]:
            assert 0.0 <= fn(response, answer) <= 1.0


def test_unknown_reward_lists_valid_names():
    with pytest.raises(ValueError, match=r"reward.name 'nope'.*digit_match.*exact_match"):
        get_reward_fn("nope")
