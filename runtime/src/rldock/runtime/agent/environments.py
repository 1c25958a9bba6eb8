"""Built-in environments (`agent.environment.name`): what answers a turn that ends without a tool call.

`feedback` tells the model whether its final answer is right and, when it is not, asks for another
try; the rollout loop gives it one until agent.max_turns. Right and wrong are decided exactly as the
`math_verify` reward decides them (rewards/math_answer.py), so the environment never accepts an
answer the reward scores 0, nor rejects one it scores 1.
"""

from __future__ import annotations

import asyncio

from rldock.runtime.agent.interfaces import (
    ENVIRONMENTS,
    Environment,
    EnvironmentSession,
    EpisodeContext,
    Observation,
)
from rldock.runtime.rewards.math_answer import extract_answer, math_verify_reward

WRONG = "That is not right. Check your work and give the final answer again."
NO_ANSWER = "That is not right: no final answer was found. Check your work and end your answer with {form}."


@ENVIRONMENTS.register("feedback")
class FeedbackEnvironment(Environment):
    """Accepts a final answer that equals the sample's ground truth mathematically (after `####`, in a
    `\\boxed{}`, or the last number or expression); answers anything else with a request to try again,
    which names the expected form when no answer was found at all. A ground truth with no answer in it
    is a data error (ValueError naming the sample's data source), as it is for the reward."""

    def session(self) -> EnvironmentSession:
        return FeedbackSession()


class FeedbackSession(EnvironmentSession):
    """One episode's checks: the sample's row, kept from the reset."""

    context: EpisodeContext

    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        self.context = context
        return Observation()

    async def step(self, text: str) -> Observation:
        # SymPy runs in a worker thread so the tools' event loop keeps answering other episodes' calls.
        # Off the main thread math-verify has no time limit (it times out with signal.alarm), as in a
        # reward worker's thread.
        return await asyncio.to_thread(check, text, self.context)


def check(final_text: str, context: EpisodeContext) -> Observation:
    """The verdict on a final answer, computed in the calling thread."""
    score = math_verify_reward(context.data_source, final_text, context.ground_truth, dict(context.extra_info))
    if score == 1.0:
        return Observation(done=True)
    if extract_answer(final_text):
        return Observation(message=WRONG)
    form = "`\\boxed{<answer>}`" if "\\boxed" in context.ground_truth else "`#### <answer>`"
    return Observation(message=NO_ANSWER.format(form=form))
