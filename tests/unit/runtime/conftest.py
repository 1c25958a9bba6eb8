"""Fixtures for the runtime's unit tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from reward_model_builder import build_tiny_reward_model


def _kill_and_wait_until_dead(handle, timeout_s: float = 60.0) -> None:
    """The product's own wait (rldock.runtime.workers.cluster.end_actors): a test waits for the state it
    needs, the actor dead and its process gone, not for a guess."""
    from rldock.runtime.workers.cluster import end_actors

    assert not end_actors([handle], timeout_s=timeout_s), f"actor {handle} still runs {timeout_s} s after ray.kill"


@pytest.fixture
def kill_actor() -> Callable[..., None]:
    """Kill a Ray actor and return once it is dead."""
    return _kill_and_wait_until_dead


@pytest.fixture
def tiny_reward_model():
    """`build_tiny_reward_model(path, *, texts, ...)`: a tiny reward model folder."""
    return build_tiny_reward_model
