"""The `feedback` environment: right answers end the episode, wrong ones ask for another try, and it
agrees with the math_verify reward on what is right."""

import asyncio

import pytest

from rldock.runtime.agent.environments import NO_ANSWER, WRONG, FeedbackEnvironment
from rldock.runtime.agent.interfaces import ENVIRONMENTS, EpisodeContext, Observation
from rldock.runtime.rewards.math_answer import math_verify_reward


def respond(text: str, ground_truth: str = "#### 42") -> Observation:
    """The feedback environment's answer to `text` as an episode's first step."""
    context = EpisodeContext(ground_truth=ground_truth, data_source="gsm8k")

    async def episode() -> Observation:
        session = FeedbackEnvironment().session()
        assert await session.reset(seed=0, episode_id="e", context=context) == Observation()
        try:
            return await session.step(text)
        finally:
            await session.close()

    return asyncio.run(episode())


def test_feedback_is_the_registered_environment_of_its_name():
    assert ENVIRONMENTS.get("feedback") is FeedbackEnvironment


@pytest.mark.parametrize(
    "text, ground_truth",
    [
        ("6 * 7 = 42\n#### 42", "#### 42"),
        ("So the answer is \\boxed{42}.", "#### 42"),
        ("It costs 1,000 dollars.\n#### 1000", "Half of 2000 is 1000.\n#### 1000"),
        ("#### 3/4", "\\boxed{\\frac{3}{4}}"),
    ],
)
def test_a_right_answer_ends_the_episode(text, ground_truth):
    assert respond(text, ground_truth) == Observation(done=True)


def test_a_wrong_answer_asks_for_another_try():
    assert respond("6 * 7 = 48\n#### 48") == Observation(message=WRONG)


@pytest.mark.parametrize(
    "ground_truth, form",
    [("#### 42", "`#### <answer>`"), ("\\boxed{42}", "`\\boxed{<answer>}`")],
)
def test_no_answer_at_all_says_which_form_is_expected(ground_truth, form):
    reply = respond("I am not sure.", ground_truth)
    assert reply == Observation(message=NO_ANSWER.format(form=form)) and form in reply.message


@pytest.mark.parametrize("text", ["#### 42", "#### 41", "\\boxed{42}", "the answer is 42.0", "no idea"])
def test_it_accepts_exactly_what_the_math_verify_reward_scores_1(text):
    assert respond(text).done == (math_verify_reward("gsm8k", text, "#### 42", {}) == 1.0)


def test_a_ground_truth_without_an_answer_is_a_data_error_naming_the_source():
    with pytest.raises(ValueError, match="cannot parse the ground truth .* data_source 'gsm8k'"):
        respond("#### 1", ground_truth="see the figure")
