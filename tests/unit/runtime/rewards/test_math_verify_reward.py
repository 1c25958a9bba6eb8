"""math_verify: the final answer of the response against the ground truth, compared as math."""

import pytest

from rldock.runtime.rewards.math_answer import extract_answer, math_verify_reward

GSM8K_GOLD = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


@pytest.mark.parametrize(
    "response, gold, expected",
    [
        ("The answer is 72", GSM8K_GOLD, 1.0),
        ("48 in April, 24 in May, so 72 in all.", GSM8K_GOLD, 1.0),  # the last number
        ("She sold 48 and 24, 72 clips.\n#### 72", GSM8K_GOLD, 1.0),
        ("#### 72.0", "#### 72", 1.0),
        ("72.0", "72", 1.0),
        ("so it is \\boxed{72}", GSM8K_GOLD, 1.0),
        ("#### 1000", "#### 1,000", 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("3/4", "\\boxed{\\frac{3}{4}}", 1.0),
        ("the roots sum to \\boxed{x+1}", "x+1", 1.0),
        ("#### x + 1", "#### 1+x", 1.0),  # a bare expression after ####
        ("#### 72 clips", GSM8K_GOLD, 1.0),
        ("The answer is 71", GSM8K_GOLD, 0.0),
        ("#### 72 is wrong, #### 70", "#### 72", 0.0),  # the last #### decides
        ("72 then \\boxed{70}", "72", 0.0),  # a boxed answer beats a later bare number
        ("I do not know", GSM8K_GOLD, 0.0),  # no answer at all
        ("", "#### 72", 0.0),
    ],
)
def test_math_verify_scores(response, gold, expected):
    assert math_verify_reward("gsm8k", response, gold, {}) == expected


@pytest.mark.parametrize("gold", ["#### ", "no number here", ""])
def test_an_unparsable_ground_truth_is_an_error_naming_the_data_source_and_the_text(gold):
    with pytest.raises(ValueError, match=r"cannot parse the ground truth .* data_source 'gsm8k'") as caught:
        math_verify_reward("gsm8k", "42", gold, {})
    assert repr(gold) in str(caught.value)


def test_extract_answer_prefers_the_last_hash_line_then_boxed_then_the_last_number():
    assert [str(x) for x in extract_answer("7 apples\n#### 5")] == ["5"]
    assert [str(x) for x in extract_answer("7, then \\boxed{6}, then 8")] == ["6"]
    assert [str(x) for x in extract_answer("7 apples and 8 pears")] == ["8"]
    assert extract_answer("none") == []
