"""Fixtures for the runtime's unit tests."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from reward_model_builder import build_tiny_reward_model


def _kill_and_wait_until_dead(handle, timeout_s: float = 60.0) -> None:
    """`ray.kill` only asks for the kill: until Ray has acted on it, calls still reach the actor.
    Wait for the state a test needs, a call that fails because the actor died, not for a guess."""
    import ray
    from ray.exceptions import RayActorError

    ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except RayActorError:
            return
        time.sleep(0.01)
    raise TimeoutError(f"actor {handle} still answers {timeout_s} s after ray.kill")


@pytest.fixture
def kill_actor() -> Callable[..., None]:
    """Kill a Ray actor and return once it is dead."""
    return _kill_and_wait_until_dead


@pytest.fixture
def tiny_reward_model():
    """`build_tiny_reward_model(path, *, texts, ...)`: a tiny reward model folder."""
    return build_tiny_reward_model
