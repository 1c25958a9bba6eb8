"""Leader election (leader.py) against an in-memory Lease store with the API server's optimistic
concurrency (a write with a stale resourceVersion gets 409), on fake clocks: who leads, when a
standby takes over, when a leader gives up, and what release does. tests/integration/
test_operator_ha.py runs two operators on a real API server."""

from __future__ import annotations

import copy
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from rldock.operator.leader import LeaderElector, LeaseError, LeaseTimings, lease_rules, micro_time

NS, NAME = "rldock-system", "rldock-operator"
TIMINGS = LeaseTimings(lease_duration=15, renew_deadline=10, retry_period=2)


class FakeLeases:
    """One namespace's Leases, as the API server keeps them; `down` makes every call fail."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.down = False
        self.calls: list[str] = []

    def _check(self, call: str, timeout: float) -> None:
        assert timeout > 0, f"{call} with no time left"
        self.calls.append(call)
        if self.down:
            raise LeaseError(503, "Service Unavailable")

    def _stored(self, body: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.leases[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    def read(self, namespace: str, name: str, *, timeout: float) -> dict[str, Any] | None:
        self._check("read", timeout)
        return copy.deepcopy(self.leases.get(name))

    def create(self, namespace: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        self._check("create", timeout)
        if body["metadata"]["name"] in self.leases:
            raise LeaseError(409, "AlreadyExists")
        return self._stored(body)

    def replace(self, namespace: str, name: str, body: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        self._check("replace", timeout)
        if self.leases[name]["metadata"]["resourceVersion"] != body["metadata"].get("resourceVersion"):
            raise LeaseError(409, "Conflict")
        return self._stored(body)

    def holder(self) -> str | None:
        return self.leases[NAME]["spec"].get("holderIdentity")


class Clock:
    """Monotonic and wall time together; sleep() advances both."""

    def __init__(self) -> None:
        self.now = 100.0
        self.epoch = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def __call__(self) -> float:
        return self.now

    def wall(self) -> datetime:
        return self.epoch + timedelta(seconds=self.now)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def elector(leases: FakeLeases, clock: Clock, identity: str, **kwargs: Any) -> LeaderElector:
    return LeaderElector(
        leases,
        namespace=NS,
        name=NAME,
        identity=identity,
        timings=TIMINGS,
        clock=clock,
        wall_clock=clock.wall,
        sleep=clock.sleep,
        **kwargs,
    )


@pytest.fixture
def leases() -> FakeLeases:
    return FakeLeases()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_the_first_replica_creates_the_lease_and_the_second_stands_by(leases, clock):
    changes: list[bool] = []
    a, b = elector(leases, clock, "a", on_change=changes.append), elector(leases, clock, "b")
    assert a.try_acquire_or_renew() and a.leading and changes == [True]
    assert not b.try_acquire_or_renew() and not b.leading
    spec = leases.leases[NAME]["spec"]
    assert spec["holderIdentity"] == "a" and spec["leaseDurationSeconds"] == 15 and spec["leaseTransitions"] == 0
    assert spec["renewTime"] == micro_time(clock.wall()) and spec["renewTime"].endswith(".000000Z")


def test_a_renewed_lease_is_never_taken(leases, clock):
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    a.try_acquire_or_renew()
    for _ in range(30):  # a minute of renewals every 2 s: b never sees it expire
        clock.sleep(2)
        assert a.try_acquire_or_renew()
        assert not b.try_acquire_or_renew()
    assert leases.holder() == "a"


def test_a_standby_takes_an_unrenewed_lease_after_its_duration_on_its_own_clock(leases, clock):
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    a.try_acquire_or_renew()  # then a is killed: no more renewals, no release
    assert not b.try_acquire_or_renew()  # b sees the record now
    clock.sleep(14.9)
    assert not b.try_acquire_or_renew()
    clock.sleep(0.2)
    assert b.try_acquire_or_renew() and leases.holder() == "b"
    assert leases.leases[NAME]["spec"]["leaseTransitions"] == 1


def test_acquire_blocks_until_the_killed_leader_lease_expires(leases, clock):
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    a.try_acquire_or_renew()
    killed = clock.now
    assert b.acquire()
    # lease duration plus at most one jittered retry period
    assert TIMINGS.lease_duration <= clock.now - killed <= TIMINGS.lease_duration + 2 * TIMINGS.retry_period


def test_of_two_standbys_taking_an_expired_lease_one_wins(leases, clock):
    a, b, c = elector(leases, clock, "a"), elector(leases, clock, "b"), elector(leases, clock, "c")
    a.try_acquire_or_renew()
    b.try_acquire_or_renew(), c.try_acquire_or_renew()
    clock.sleep(16)
    stale = leases.read(NS, NAME, timeout=1)  # c reads, then b writes first
    assert b.try_acquire_or_renew()
    stale["spec"]["holderIdentity"] = "c"
    with pytest.raises(LeaseError) as conflict:
        leases.replace(NS, NAME, stale, timeout=1)
    assert conflict.value.status == 409
    assert not c.try_acquire_or_renew() and leases.holder() == "b"  # c saw b's fresh record


def test_a_restarted_replica_with_the_same_identity_takes_its_lease_back_at_once(leases, clock):
    elector(leases, clock, "pod-1").try_acquire_or_renew()
    restarted = elector(leases, clock, "pod-1")  # the container restarted in the same pod
    assert restarted.try_acquire_or_renew() and leases.holder() == "pod-1"
    assert leases.leases[NAME]["spec"]["leaseTransitions"] == 0


def test_a_leader_that_cannot_renew_gives_up_at_the_renew_deadline(leases, clock):
    a = elector(leases, clock, "a")
    a.try_acquire_or_renew()
    leases.down = True
    clock.sleep(2)
    assert a.try_acquire_or_renew() and a.leading  # a failed renewal within the deadline: still leading
    clock.sleep(8.01)
    assert not a.try_acquire_or_renew() and not a.leading
    # Before the standby's lease duration (15 s after it last saw the record) ends.
    assert TIMINGS.renew_deadline < TIMINGS.lease_duration


def test_no_leader_request_outlives_the_renew_deadline(leases, clock):
    a = elector(leases, clock, "a")
    a.try_acquire_or_renew()
    clock.sleep(9.5)
    seen: list[float] = []
    original = leases.read
    leases.read = lambda ns, name, *, timeout: (seen.append(timeout), original(ns, name, timeout=timeout))[1]
    a.try_acquire_or_renew()
    assert seen and seen[0] == pytest.approx(0.5)


def test_a_leader_whose_lease_was_taken_stops_leading(leases, clock):
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    a.try_acquire_or_renew()
    b.try_acquire_or_renew()
    clock.sleep(16)  # a was paused (e.g. a stalled node) longer than the lease
    assert b.try_acquire_or_renew()
    assert not a.try_acquire_or_renew() and not a.leading and leases.holder() == "b"


def test_keep_leading_calls_on_lost_once_renewals_fail():
    leases, lost = FakeLeases(), threading.Event()
    fast = LeaseTimings(lease_duration=0.6, renew_deadline=0.4, retry_period=0.05)
    a = LeaderElector(leases, namespace=NS, name=NAME, identity="a", timings=fast)
    assert a.acquire()
    a.keep_leading(on_lost=lost.set)
    assert not lost.wait(0.3) and leases.calls.count("replace") >= 3  # renewing
    leases.down = True
    assert lost.wait(2.0) and not a.leading


def test_release_clears_the_holder_so_a_standby_takes_over_at_once(leases, clock):
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    a.release()
    assert not a.leading and leases.holder() is None
    assert b.try_acquire_or_renew() and leases.holder() == "b"  # no waiting for the lease duration
    a.release()  # not leading: nothing written
    assert leases.holder() == "b"


def test_release_leaves_a_lease_someone_else_holds(leases, clock):
    a, b = elector(leases, clock, "a"), elector(leases, clock, "b")
    a.try_acquire_or_renew()
    b.try_acquire_or_renew()
    clock.sleep(16)
    b.try_acquire_or_renew()
    a.release()
    assert leases.holder() == "b"


@pytest.mark.parametrize(
    "timings",
    [
        dict(lease_duration=10, renew_deadline=10, retry_period=2),  # a standby could take over before the leader stops
        dict(lease_duration=15, renew_deadline=2, retry_period=2),
        dict(lease_duration=15, renew_deadline=10, retry_period=0),
    ],
)
def test_inconsistent_timings_are_refused(timings):
    with pytest.raises(ValueError):
        LeaseTimings(**timings)


def test_rbac_rules_name_the_lease_for_get_and_update():
    create, named = lease_rules("my-lease")
    assert create == {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}
    assert named["resourceNames"] == ["my-lease"] and named["verbs"] == ["get", "update"]
