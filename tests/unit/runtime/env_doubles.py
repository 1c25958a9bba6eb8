"""TEST DOUBLES: rldock environments that env_server/test_serve.py serves with `rldock env serve
tests/unit/runtime/env_doubles.py:CountingEnvironment`, in a process of their own.

CountingEnvironment keeps each episode's state (its seed, id and row, and the steps so far), so sessions
that share it prove they are kept apart; it raises when asked to (a reset with ground truth "raise", a
step "raise"), and appends each closed session's episode id to the file `closed_log` (an option), which
proves that sessions are closed on every path. A step "hang" never answers (until it is cancelled).

VariablesEnvironment answers a reset with the names of the server process's environment variables, and
whether RLDOCK_ENV_TOKEN is among them, which shows what a server rldock starts is given.
"""

from __future__ import annotations

import asyncio
import json
import os

from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, EpisodeContext, Observation


class CountingEnvironment(Environment):
    """Counts each episode's steps and says what it was reset with."""

    def __init__(self, closed_log: str = ""):
        self.closed_log = closed_log

    def session(self) -> EnvironmentSession:
        return CountingSession(self.closed_log)


class CountingSession(EnvironmentSession):
    def __init__(self, closed_log: str):
        self.closed_log = closed_log
        self.episode_id = ""
        self.seed = -1
        self.steps = 0

    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        self.seed, self.episode_id = seed, episode_id
        if context.ground_truth == "raise":
            raise ValueError("asked to raise at reset")
        row = {"ground_truth": context.ground_truth, "data_source": context.data_source, **context.extra_info}
        return Observation(message=f"seed {seed}: {json.dumps(row, sort_keys=True)}")

    async def step(self, text: str) -> Observation:
        if text == "raise":
            raise RuntimeError("asked to raise at a step")
        if text == "hang":
            await asyncio.Event().wait()
        self.steps += 1
        return Observation(
            message=f"step {self.steps} of seed {self.seed}: {text}",
            reward=float(self.steps),
            done=text == "stop",
            fields={"steps": self.steps, "seed": self.seed},
        )

    async def close(self) -> None:
        if self.closed_log:
            with open(self.closed_log, "a") as log:
                log.write(f"{self.episode_id}\n")


class VariablesEnvironment(Environment):
    """Says which environment variables its server process has (their names, never their values)."""

    def session(self) -> EnvironmentSession:
        return VariablesSession()


class VariablesSession(EnvironmentSession):
    async def reset(self, *, seed: int, episode_id: str, context: EpisodeContext) -> Observation:
        return Observation(message=json.dumps(sorted(os.environ)))

    async def step(self, text: str) -> Observation:
        return Observation(message=os.environ.get(text, ""), done=True)
