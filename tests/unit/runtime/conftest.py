"""Fixtures for the runtime's unit tests."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
from reward_model_builder import build_tiny_reward_model


def _kill_and_wait_until_dead(handle, timeout_s: float = 60.0) -> None:
    """`ray.kill` only asks for the kill: until Ray has acted on it, calls still reach the actor, and
    Ray reports it dead a moment before its process has ended (while the process may still answer
    on its node, e.g. the dock host's local socket). Wait for the state a test needs, a call that
    fails because the actor died and its process gone, not for a guess."""
    import ray
    from ray.exceptions import RayActorError

    from rldock.runtime.dock.shared_columns import process_runs

    pid = ray.get(handle.__ray_call__.remote(lambda actor: os.getpid()), timeout=timeout_s)
    ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except RayActorError:
            break
        time.sleep(0.01)
    else:
        raise TimeoutError(f"actor {handle} still answers {timeout_s} s after ray.kill")
    while process_runs(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"actor {handle}'s process {pid} still runs {timeout_s} s after ray.kill")
        time.sleep(0.01)


@pytest.fixture
def kill_actor() -> Callable[..., None]:
    """Kill a Ray actor and return once it is dead."""
    return _kill_and_wait_until_dead


@pytest.fixture
def tiny_reward_model():
    """`build_tiny_reward_model(path, *, texts, ...)`: a tiny reward model folder."""
    return build_tiny_reward_model
