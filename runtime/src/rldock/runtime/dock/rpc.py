"""Calls from the dock client to the dock's actors: each call is named after the actor it goes to.

An actor that died makes the call fail at once with DockActorDiedError naming it; an error that is
the caller's fault (a bad index, a timeout) is re-raised as itself rather than wrapped in Ray's
RayTaskError. While a consumer waits for a grant, the other dock actors are pinged now and then, so
a dead warehouse is reported even when the request itself would otherwise just wait.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rldock.runtime.dock.errors import DockActorDiedError, DockTimeoutError

# Errors raised inside a dock actor that are the caller's fault: re-raised as themselves.
_CALLER_ERRORS = (DockTimeoutError, ValueError, IndexError, KeyError)
# A request outlives the controller's own timeout only if the controller is broken.
RPC_GRACE_S = 60.0
# While waiting for a grant, how often the other dock actors are checked for being alive.
HEALTH_INTERVAL_S = 2.0


class Peer(NamedTuple):
    """A dock actor and the name errors call it by, e.g. "warehouse 1 (samples [8, 16))"."""

    name: str
    handle: ActorHandle


def get(name: str, ref: ray.ObjectRef, timeout: float | None = None) -> Any:
    """ray.get of one call to the actor called `name`, with the dock's error mapping."""
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as err:
        if isinstance(err.cause, _CALLER_ERRORS):
            raise err.cause from None
        raise
    except RayActorError as err:
        raise died(name, _cause(err)) from None


def get_all(calls: Sequence[tuple[str, ray.ObjectRef]]) -> list[Any]:
    """Results of calls already in flight (they run in parallel), in order; the first failure raises."""
    return [get(name, ref) for name, ref in calls]


def wait_for_grant(name: str, ref: ray.ObjectRef, *, timeout: float, watch: Sequence[Peer]) -> Any:
    """The answer of a (possibly long-waiting) request to `name`, checking `watch` while it waits."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        ready, _ = ray.wait([ref], timeout=max(0.0, min(HEALTH_INTERVAL_S, left)))
        if ready:
            return get(name, ref)
        if left <= 0:
            raise unanswered(name, timeout)
        check_alive(watch)


def unanswered(name: str, timeout: float) -> DockTimeoutError:
    """The error for the dock actor called `name` that has not answered a request in `timeout` seconds."""
    return DockTimeoutError(
        f"transfer dock: {name} did not answer within {timeout:g}s, though its own timeout "
        "is shorter; it is stuck or overloaded"
    )


def check_alive(peers: Sequence[Peer]) -> None:
    """Raise DockActorDiedError naming the first dead peer; busy peers (no answer yet) count as alive."""
    pings: list[tuple[str, ray.ObjectRef]] = [(peer.name, peer.handle.ping.remote()) for peer in peers]
    ready, _ = ray.wait([ref for _, ref in pings], num_returns=len(pings), timeout=HEALTH_INTERVAL_S)
    done = set(ready)
    for name, ref in pings:
        if ref in done:
            with contextlib.suppress(GetTimeoutError):
                get(name, ref, timeout=0)


def died(name: str, cause: str) -> DockActorDiedError:
    """The error for the dock actor called `name` found dead because of `cause`."""
    return DockActorDiedError(
        f"transfer dock: {name} is dead ({cause}). The samples it held or tracked this iteration are "
        "lost; fail the job and let its retry resume from the last checkpoint."
    )


def _cause(err: RayActorError) -> str:
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return f"{type(err).__name__}: {reason}"
