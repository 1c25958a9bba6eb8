"""SlowAddition: a TEST DOUBLE of an environment whose steps take a while, served in an RLJob's
environment pods (`rldock env serve rldock_e2e.doubles.slow_environment:SlowAddition`; the venv is
every pod's image, so the class imports there).

Each session is one addition question (the train row's ground truth): every model turn is stepped,
sleeps `step_seconds` (an environment that runs something: a build, a game engine), and is rewarded
1.0 when it is the answer, else 0.0 with "try again". It never says done, so every episode runs to
`agent.max_turns` and its session stays open for max_turns steps: long enough for a scenario to
find sessions open on a replica and take that replica away under them (tests/e2e/
test_environment_scenarios.py).
"""

from __future__ import annotations

import asyncio

from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, EpisodeContext, Observation


class SlowAddition(Environment):
    """One addition question per session; each step takes `step_seconds` (a string: `--option`)."""

    def __init__(self, step_seconds: str = "0") -> None:
        self.step_seconds = float(step_seconds)
        if self.step_seconds < 0:
            raise ValueError(f"step_seconds must be >= 0, got {step_seconds}")

    def session(self) -> EnvironmentSession:
        return _Session(self.step_seconds)


class _Session(EnvironmentSession):
    def __init__(self, step_seconds: float) -> None:
        self.step_seconds = step_seconds
        self.answer = ""

    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        self.answer = context.ground_truth.strip()
        return Observation()

    async def step(self, text: str) -> Observation:
        await asyncio.sleep(self.step_seconds)
        right = text.strip() == self.answer
        return Observation(message=None if right else "try again", reward=1.0 if right else 0.0)
