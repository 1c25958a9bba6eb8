"""A reconcile round's records: the RLJob as the round found it (`Round`), what it saw of the cluster
(`Seen`), what it wants written (`Outcome`), and the two ways a round ends early (`SkipRound`,
`BlockedRound`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rldock.config import Problem
from rldock.operator import naming
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.builders import RLJobRef
from rldock.operator.constants import MANAGED_BY_RLDOCK, EventReason
from rldock.operator.desired import Desired
from rldock.operator.facts import Blocked, RayJobObservation, RoundFacts
from rldock.operator.observe import PodSummary, Progress
from rldock.operator.rayjobs import RayJobsClient
from rldock.operator.rules import Rule, classify
from rldock.operator.status import Event, parse_status

JobsClientFactory = Callable[[str, str | None], RayJobsClient]


class SkipRound(Exception):
    """Something could not be read (or is going away): decide nothing this round."""


class BlockedRound(Exception):
    """A child cannot be had until a person acts: say so in the status (status.Blocked)."""

    def __init__(self, blocked: Blocked) -> None:
        super().__init__(blocked.message)
        self.blocked = blocked


@dataclass
class Outcome:
    """What a round wants written: the full new status (None: leave it) and Events to post."""

    status: dict[str, Any] | None = None
    events: list[Event] = field(default_factory=list)

    def event(self, type_: str, reason: EventReason, message: str) -> None:
        self.events.append(Event(type_, reason, message))


@dataclass(frozen=True)
class Round:
    ref: RLJobRef
    desired: Desired  # the spec's generation worked out (desired.py): parsed, checked, its children
    raw_status: dict[str, Any]
    facts: RoundFacts  # what the RLJob says; the round adds what it reads of the cluster

    @property
    def spec(self) -> RLJobSpec | None:
        return self.facts.spec

    @property
    def problems(self) -> list[Problem]:
        return self.desired.problems

    @property
    def previous(self) -> RLJobStatus:
        return self.facts.previous

    @property
    def now(self) -> datetime:
        return self.facts.now

    @property
    def cluster_name(self) -> str:
        return naming.ray_cluster_name(self.ref.name)

    def submission_id(self, attempt: int) -> str:
        return naming.ray_job_submission_id(self.ref.name, self.ref.uid, attempt=attempt)


@dataclass(frozen=True)
class Seen:
    """What observing the cluster's pods and its Jobs API found."""

    summary: PodSummary = PodSummary()
    job: RayJobObservation | None = None
    progress: Progress = Progress()
    lost: tuple[str, ...] = ()
    workers_terminating: tuple[str, ...] = ()  # worker pods being deleted while the Ray job runs
    previous_attempt: RayJobObservation | None = None
    jobs: RayJobsClient | None = None  # set when the head is up


def begin_round(body: Mapping[str, Any], now: datetime, desired: Desired) -> Round:
    raw_status = dict(body.get("status") or {})
    facts = RoundFacts(
        name=desired.ref.name,
        now=now,
        spec=desired.spec,
        problems=desired.problems,
        denied=desired.denied,
        previous=parse_status(raw_status),
        generation=body["metadata"].get("generation"),
    )
    return Round(ref=desired.ref, desired=desired, raw_status=raw_status, facts=facts)


def managed_elsewhere(body: Mapping[str, Any]) -> bool:
    """spec.managedBy names another controller (Kueue's convention, e.g. MultiKueue's dispatcher)."""
    manager = (body.get("spec") or {}).get("managedBy")
    return manager is not None and manager != MANAGED_BY_RLDOCK


def looked_rule(facts: RoundFacts) -> Rule:
    """The rule of facts that include the cluster's (classify decides on them)."""
    rule = classify(facts)
    assert rule is not None, "facts that were looked at decide"
    return rule
