"""The kopf handlers: thin wiring from changes of RLJobs and their children to the reconciler.

One reconcile round (reconcile/) is level-based: it reads the world and moves the RLJob one step
towards its spec, then the round patches the status (only when it changed) and posts its Events.
Creation, spec edits, suspend and TTL all go through it; there are no create/update handlers whose
missed events could leave an RLJob behind. What decides WHEN a round runs is here:

- a daemon per RLJob (kopf.daemon) runs the rounds of that RLJob one after another, never two at
  once, each in a thread (the reconciler is synchronous). Between rounds it waits on the RLJob's
  wake-up (Wakeups) with a timeout `seconds_until_next_round` picks from the status just written:
  the poll interval only while the Ray job may be moving (its progress and state exist only in the
  head's Jobs API, which no watch reports), the slow RESYNC_INTERVAL otherwise.
- watch handlers (kopf.on.event) wake an RLJob's daemon when the RLJob's spec changes (a new
  generation; the round's own status writes do not count) and when one of its children changes:
  its RayCluster (by name, or by the `rldock.io/rljob` label) and the RayCluster's pods (KubeRay
  labels them `ray.io/cluster`; they carry our `rldock.io/rljob` too). So an RLJob whose cluster
  is waiting (nodes, Kueue, a suspend) costs nothing until something happens to it. The
  environments' Deployments (label `rldock.io/environment`) wake it too, so their ready pods reach
  its status as they come.
- a deletion handler behind the finalizer `rldock.io/cleanup`: stop the Ray job; the children go
  by owner references (garbage collector). It is best effort and never raises, so the finalizer
  comes off whatever the cluster answers; nothing in it writes the status.

A round never raises for the API server's answers: the round writes the status itself
(Reconciler.write_status), not through kopf's patch, so a status the API server refuses becomes a
condition; an unreachable or erroring API server ends the round, and the next comes one poll
interval later. Kopf keeps its own bookkeeping in annotations, not in `status.kopf`: the RLJob's
status schema is structural and the API server would prune it. Annotations that do not parse
(someone edited them) count as absent and are rewritten (kopf_storage.py), rather than failing every
event of the RLJob. An invalid spec is not a kopf.PermanentError: the round writes phase Failed
once, and later rounds find nothing to change (no hot loop, no patch).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from rldock.operator import naming
from rldock.operator.constants import (
    FINALIZER,
    GROUP,
    LABEL_AGENT,
    LABEL_ENVIRONMENT,
    LABEL_RAY_CLUSTER,
    LABEL_RLJOB,
    PLURAL,
    RAY_API_VERSION,
    RAY_CLUSTER_PLURAL,
    VERSION,
    ConditionType,
    EventReason,
    Phase,
    Reason,
)
from rldock.operator.kopf_storage import TolerantDiffBaseStorage, TolerantProgressStorage
from rldock.operator.reconcile import Reconciler
from rldock.operator.settings import OperatorSettings
from rldock.operator.status import parse_status, seconds_until_expiry, status_changed
from rldock.operator.validation import parse_spec

log = logging.getLogger(__name__)

HANDLER_ID = "reconcile"
# A round of an RLJob nothing happened to, so that a change whose watch event was lost (a dropped
# stream is re-listed, but an event between two lists can be missed) or a change no watch sees (a
# Jobs API that came back, a quota raised) is still acted on. Five minutes: 100 idle RLJobs then
# cost one round every 3 s in all, about 0.3% of a core (docs/operator.md), and nothing an idle
# RLJob waits for (nodes, Kueue's admission, a person's fix) is usually quicker than that.
RESYNC_INTERVAL = 300.0
# A blocked RLJob (a child's name taken, a create refused by a quota or an admission webhook)
# waits for a fix outside anything it watches (a ResourceQuota, a webhook), so it looks again
# sooner than an idle one.
BLOCKED_RETRY_INTERVAL = 60.0
# Children change in bursts (KubeRay creating a head and its workers, a scheduler binding them):
# one round after the burst instead of one per event.
COALESCE_SECONDS = 0.25
# A finished RLJob with ttlSecondsAfterFinished wakes this long after the TTL ends, so the round
# finds it expired.
TTL_SLACK_SECONDS = 1.0
_BLOCKED = (Reason.NAME_CONFLICT, Reason.CREATE_REFUSED, Reason.TOKEN_REFUSED)

_RAY_GROUP, _RAY_VERSION = RAY_API_VERSION.split("/")
Key = tuple[str, str]  # (namespace, RLJob name)


def configure_kopf(settings: kopf.OperatorSettings, ours: OperatorSettings) -> kopf.OperatorSettings:
    """Kopf's settings for the rldock operator."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = TolerantProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = TolerantDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    # No watching of CRDs and namespaces (which would need cluster-wide RBAC): the RLJob CRD must
    # exist when the operator starts (__main__ checks) and namespaces are named, or all of them.
    settings.scanning.disabled = True
    settings.posting.reporting_component = "rldock-operator"
    # A round in progress when the RLJob is deleted (it runs in a thread and is not cancelled) is
    # checked again after this long, not kopf's default 60 s, before the finalizer comes off.
    settings.background.cancellation_polling = ours.poll_interval
    # Watch streams are re-opened now and then, so a silently dropped connection heals itself.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    return {key: copy.deepcopy(value) for key, value in body.items()}


# --- one round ------------------------------------------------------------------------------------


def reconcile(raw: dict[str, Any], reconciler: Reconciler, logger: kopf.Logger) -> dict[str, Any] | None:
    """One round of the RLJob `raw` (a plain copy of its body); the status it has after the round,
    or None when the round decided nothing (an API error, a lookup that failed).

    Never raises for the API server's answers: the daemon would be restarted only after kopf's
    backoff, and the next round should come at the poll pace instead."""
    started = time.monotonic()
    error: str | None = None
    status: dict[str, Any] | None = None
    events: list[Any] = []
    try:
        outcome = reconciler.reconcile(raw)
        events = list(outcome.events)
        status = outcome.status
        if status is not None and status_changed(raw.get("status"), status):
            events += reconciler.write_status(raw, status)
    except ApiException as exc:  # the API server will answer again next round
        logger.warning("Kubernetes API error, retrying next round: %s %s", exc.status, exc.reason)
        error, status, events = f"http_{exc.status}", None, []
    except HTTPError as exc:  # no answer at all
        logger.warning("Kubernetes API unreachable, retrying next round: %s", exc)
        error, status, events = "unreachable", None, []
    _count(reconciler, raw, status, seconds=time.monotonic() - started, error=error)
    for event in events:
        kopf.event(raw, type=event.type, reason=event.reason.value, message=event.message)  # type: ignore[arg-type]  # kopf.event reads any mapping, typed Body
    return status


def _count(
    reconciler: Reconciler,
    raw: Mapping[str, Any],
    status: Mapping[str, Any] | None,
    *,
    seconds: float,
    error: str | None,
) -> None:
    """The round in the operator's metrics: its duration and error, the phase, new progress."""
    metrics = reconciler.metrics
    if metrics is None:
        return
    meta = raw["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    metrics.reconciled(seconds=seconds, error=error)
    before = raw.get("status") or {}
    after = status if status is not None else before
    if after.get("phase"):
        metrics.set_phase(namespace, name, after["phase"])
    if after.get("iteration") is not None and after.get("iteration") != before.get("iteration"):
        metrics.progress_seen(namespace, name)
    if after.get("rolloutMismatchKl") is not None:
        metrics.mismatch_seen(namespace, name, float(after["rolloutMismatchKl"]))


def seconds_until_next_round(
    body: Mapping[str, Any], status: Mapping[str, Any] | None, *, poll_interval: float, now: datetime
) -> float:
    """How long the RLJob `body` may wait for its next round when nothing it watches changes,
    given `status`, what the last round left (None: that round decided nothing)."""
    if status is None:
        return poll_interval  # an API error or a failed lookup: try again soon
    parsed = parse_status(status)
    cluster_ready = parsed.condition(ConditionType.CLUSTER_READY)
    if parsed.phase in (Phase.RUNNING, Phase.RETRYING):
        return poll_interval
    # Provisioning on a ready head, or with the job submitted: the job's start shows only in the
    # Jobs API. On a head that is not up yet, the RayCluster's and pods' changes wake the round.
    if parsed.phase is Phase.PROVISIONING and (
        parsed.ray_job_id is not None or (cluster_ready is not None and cluster_ready.status == "True")
    ):
        return poll_interval
    if cluster_ready is not None and cluster_ready.status == "False" and cluster_ready.reason in _BLOCKED:
        return BLOCKED_RETRY_INTERVAL
    if parsed.phase is not None and parsed.phase.is_terminal:
        spec, _ = parse_spec(body.get("spec") or {})
        remaining = seconds_until_expiry(spec=spec, status=status, now=now) if spec is not None else None
        if remaining is not None:
            return min(RESYNC_INTERVAL, max(remaining, 0.0) + TTL_SLACK_SECONDS)
    return RESYNC_INTERVAL


# --- when rounds run ------------------------------------------------------------------------------


class Wakeups:
    """An asyncio.Event per RLJob that has a daemon, and which RLJob a child's event is for.

    Only touched from kopf's event loop (handlers and daemons are coroutines there)."""

    def __init__(self) -> None:
        self._events: dict[Key, asyncio.Event] = {}
        self._generations: dict[Key, int | None] = {}
        self._by_cluster: dict[Key, Key] = {}  # (namespace, RayCluster name) -> RLJob
        self._by_label: dict[Key, Key] = {}  # (namespace, value of rldock.io/rljob) -> RLJob

    def __len__(self) -> int:
        return len(self._events)

    def add(self, key: Key) -> asyncio.Event:
        """The wake-up of a daemon starting for `key` (one per RLJob: kopf runs one at a time)."""
        namespace, name = key
        self._by_cluster[(namespace, naming.ray_cluster_name(name))] = key
        self._by_label[(namespace, naming.label_value(name))] = key
        self._events[key] = wake = asyncio.Event()
        return wake

    def remove(self, key: Key, wake: asyncio.Event) -> None:
        """Forget `key`, unless a newer daemon of it registered since `wake`'s did."""
        if self._events.get(key) is not wake:
            return
        del self._events[key]
        self._generations.pop(key, None)
        for index in (self._by_cluster, self._by_label):
            for child in [child for child, owner in index.items() if owner == key]:
                del index[child]

    def saw_generation(self, key: Key, generation: int | None) -> None:
        self._generations[key] = generation

    def rljob_changed(self, key: Key, generation: int | None) -> bool:
        """Wake `key` when its spec has a generation the last round did not see; whether it did.
        Status writes (the rounds' own) and kopf's annotations leave the generation as it is."""
        if key not in self._events or self._generations.get(key) == generation:
            return False
        self._events[key].set()
        return True

    def child_changed(self, namespace: str, *, cluster: str | None, rljob_label: str | None) -> list[Key]:
        """Wake the RLJobs a child belongs to (by its RayCluster's name or its rljob label)."""
        owners = {self._by_cluster.get((namespace, cluster or "")), self._by_label.get((namespace, rljob_label or ""))}
        woken = [key for key in owners if key is not None and key in self._events]
        for key in woken:
            self._events[key].set()
        return woken


async def _sleep(stopped: kopf.DaemonStopped, seconds: float, *, wake: asyncio.Event | None = None) -> None:
    """Until `seconds` pass, the daemon is stopped, or `wake` is set."""
    waiters: set[asyncio.Future[object]] = {asyncio.ensure_future(stopped.wait())}
    if wake is not None:
        waiters.add(asyncio.ensure_future(wake.wait()))
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class Handlers:
    """The handlers of one operator, sharing its Wakeups."""

    def __init__(
        self, settings: OperatorSettings, *, clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)
    ) -> None:
        self.settings = settings
        self.wakeups = Wakeups()
        self._clock = clock

    async def rounds(
        self, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, stopped: kopf.DaemonStopped, **_: Any
    ) -> None:
        """The daemon of one RLJob: a round now, then one whenever woken or its timeout passes."""
        reconciler: Reconciler = memo["reconciler"]
        key: Key = (body["metadata"]["namespace"], body["metadata"]["name"])
        wake = self.wakeups.add(key)
        try:
            while not stopped:
                wake.clear()  # before reading the body: a change after this wakes the next round
                raw = _plain(body)  # kopf replaces the live body on each event; the thread gets a copy
                self.wakeups.saw_generation(key, raw["metadata"].get("generation"))
                status = await asyncio.to_thread(reconcile, raw, reconciler, logger)  # copies contextvars
                delay = seconds_until_next_round(
                    raw, status, poll_interval=self.settings.poll_interval, now=self._clock()
                )
                log.debug("%s/%s: next round in %.1f s unless something changes", *key, delay)
                await _sleep(stopped, delay, wake=wake)
                if wake.is_set():
                    await _sleep(stopped, COALESCE_SECONDS)
        finally:
            self.wakeups.remove(key, wake)
            if reconciler.metrics is not None and body["metadata"].get("deletionTimestamp"):
                reconciler.metrics.forget(*key)  # also after a round that ended during the deletion

    async def rljob_event(self, body: kopf.Body, type: str | None, **_: Any) -> None:
        if type == "DELETED":
            return
        meta = body["metadata"]
        self.wakeups.rljob_changed((meta["namespace"], meta["name"]), meta.get("generation"))

    async def ray_cluster_event(self, body: kopf.Body, **_: Any) -> None:
        meta = body["metadata"]
        self.wakeups.child_changed(
            meta["namespace"], cluster=meta["name"], rljob_label=(meta.get("labels") or {}).get(LABEL_RLJOB)
        )

    async def environment_event(self, body: kopf.Body, **_: Any) -> None:
        meta = body["metadata"]
        self.wakeups.child_changed(
            meta["namespace"], cluster=None, rljob_label=(meta.get("labels") or {}).get(LABEL_RLJOB)
        )

    async def pod_event(self, body: kopf.Body, **_: Any) -> None:
        meta = body["metadata"]
        labels = meta.get("labels") or {}
        self.wakeups.child_changed(
            meta["namespace"], cluster=labels.get(LABEL_RAY_CLUSTER), rljob_label=labels.get(LABEL_RLJOB)
        )


def cleanup(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    reconciler: Reconciler = memo["reconciler"]
    meta = body["metadata"]
    if reconciler.metrics is not None:
        reconciler.metrics.forget(meta["namespace"], meta["name"])
    try:
        stopped = reconciler.stop_for_deletion(_plain(body))
    except ApiException as error:  # the cluster goes with the RLJob anyway (owner references)
        logger.warning("could not look for a Ray job to stop (%s %s); deleting anyway", error.status, error.reason)
        return
    except HTTPError as error:
        logger.warning("Kubernetes API unreachable (%s); deleting anyway", error)
        return
    if stopped is not None:
        kopf.event(
            body,
            type="Normal",
            reason=EventReason.STOPPED_RAY_JOB.value,
            message=f"stopped Ray job {stopped}: the RLJob is deleted",
        )
        logger.info("stopped Ray job %s", stopped)


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> kopf.OperatorRegistry:
    """Put the handlers in `registry`, with the poll interval of `settings`."""
    handlers = Handlers(settings)
    # Kopf authenticates as the kubernetes client does: in-cluster service account or $KUBECONFIG.
    kopf.on.login(registry=registry)(kopf.login_via_client)
    # backoff: a daemon that raised (a bug) is restarted at the poll pace, not kopf's default 60 s.
    kopf.daemon(
        group=GROUP, version=VERSION, plural=PLURAL, id=HANDLER_ID, registry=registry, backoff=settings.poll_interval
    )(handlers.rounds)
    kopf.on.event(group=GROUP, version=VERSION, plural=PLURAL, id="rljob-changed", registry=registry)(
        handlers.rljob_event
    )
    # Every RayCluster (a foreign one of an RLJob's cluster name blocks it until it goes), and
    # only the pods KubeRay made (label ray.io/cluster); kopf filters labels on its side.
    kopf.on.event(
        group=_RAY_GROUP, version=_RAY_VERSION, plural=RAY_CLUSTER_PLURAL, id="raycluster-changed", registry=registry
    )(handlers.ray_cluster_event)
    kopf.on.event(
        group="",
        version="v1",
        plural="pods",
        id="pod-changed",
        registry=registry,
        labels={LABEL_RAY_CLUSTER: kopf.PRESENT},
    )(handlers.pod_event)
    # The environments' and agents' Deployments (builders/pod_sets.py): their ready replicas are the status's.
    for label, id_ in ((LABEL_ENVIRONMENT, "environment-changed"), (LABEL_AGENT, "agent-changed")):
        kopf.on.event(
            group="apps", version="v1", plural="deployments", id=id_, registry=registry, labels={label: kopf.PRESENT}
        )(handlers.environment_event)
    kopf.on.delete(
        group=GROUP,
        version=VERSION,
        plural=PLURAL,
        id="cleanup",
        registry=registry,
        retries=3,
        backoff=settings.poll_interval,
    )(cleanup)
    return registry
