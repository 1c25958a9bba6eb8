"""The kopf wiring: settings, registered handlers, when rounds run (events, the poll interval only
while a Ray job may be moving, a slow resync otherwise), the status merge patch, and what keeps an
RLJob from wedging: garbage in kopf's annotations, a deletion whose cleanup fails."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from datetime import datetime, timedelta, timezone

import kopf
import pytest
import urllib3
from kubernetes.client.exceptions import ApiException
from rljob_testing import spec_dict

from rldock.operator import naming
from rldock.operator.handlers import (
    BLOCKED_RETRY_INTERVAL,
    RESYNC_INTERVAL,
    TTL_SLACK_SECONDS,
    Handlers,
    Wakeups,
    cleanup,
    configure_kopf,
    reconcile,
    register,
    seconds_until_next_round,
)
from rldock.operator.kopf_storage import TolerantDiffBaseStorage, TolerantProgressStorage
from rldock.operator.reconcile import Outcome
from rldock.operator.settings import OperatorSettings
from rldock.operator.status import status_patch

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def test_kopf_keeps_its_state_in_annotations_and_uses_our_finalizer():
    settings = configure_kopf(kopf.OperatorSettings(), OperatorSettings(poll_interval=2))
    assert settings.persistence.finalizer == "rldock.io/cleanup"
    # status.kopf would be pruned by the structural status schema
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.scanning.disabled  # no cluster-wide RBAC for CRDs and namespaces
    assert settings.background.cancellation_polling == 2


def test_a_daemon_per_rljob_watches_of_the_rljob_and_its_children_and_a_deletion_handler():
    registry = register(kopf.OperatorRegistry(), OperatorSettings(poll_interval=3))
    (daemon,) = registry._spawning.get_all_handlers()
    assert daemon.id == "reconcile" and daemon.backoff == 3 and daemon.requires_finalizer
    assert type(daemon).__name__ == "DaemonHandler"  # not a timer: it waits for events between rounds
    handlers = registry._watching.get_all_handlers()
    watched = {(h.selector.group, h.selector.plural): h for h in handlers}
    assert set(watched) == {("rldock.io", "rljobs"), ("ray.io", "rayclusters"), ("", "pods"), ("apps", "deployments")}
    assert watched[("", "pods")].labels == {"ray.io/cluster": kopf.PRESENT}  # KubeRay's pods only
    # The environments' and agents' Deployments only (spec.environments, spec.agents), so their ready pods
    # reach the status.
    deployments = [h.labels for h in handlers if (h.selector.group, h.selector.plural) == ("apps", "deployments")]
    assert deployments == [{"rldock.io/environment": kopf.PRESENT}, {"rldock.io/agent": kopf.PRESENT}]
    (deletion,) = registry._changing.get_all_handlers()
    assert deletion.id == "cleanup" and deletion.reason == kopf.Reason.DELETE


def test_status_patch_removes_what_the_new_status_lacks():
    old = {"phase": "Running", "rayJobId": "sid-0", "iteration": 3}
    new = {"phase": "Suspended", "iteration": 3}
    assert status_patch(old, new) == {"phase": "Suspended", "iteration": 3, "rayJobId": None}


# --- when the next round runs ---------------------------------------------------------------------


def _condition(type_: str, status: str, reason: str) -> dict:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": "m",
        "lastTransitionTime": "2026-01-01T11:00:00Z",
    }


def _ready(status: str, reason: str) -> dict:
    return _condition("ClusterReady", status, reason)


POLL = 2.0


@pytest.mark.parametrize(
    "status, expected",
    [
        (None, POLL),  # the round decided nothing (API error, failed lookup): again soon
        ({"phase": "Running", "rayJobId": "sid-0"}, POLL),  # progress lines only come from the Jobs API
        ({"phase": "Retrying", "restartCount": 1}, POLL),
        ({"phase": "Provisioning", "rayJobId": "sid-0"}, POLL),  # submitted: its start shows in the Jobs API
        ({"phase": "Provisioning", "conditions": [_ready("True", "RayClusterReady")]}, POLL),  # submitting
        # A cluster that is not up: its RayCluster and pods wake the round when they change.
        ({"phase": "Provisioning", "conditions": [_ready("False", "RayClusterProvisioning")]}, RESYNC_INTERVAL),
        ({"phase": "Pending", "conditions": [_ready("False", "WaitingForAdmission")]}, RESYNC_INTERVAL),
        ({"phase": "Suspended"}, RESYNC_INTERVAL),
        ({"phase": "Pending", "conditions": [_ready("False", "CreateRefused")]}, BLOCKED_RETRY_INTERVAL),
        ({"phase": "Pending", "conditions": [_ready("False", "NameConflict")]}, BLOCKED_RETRY_INTERVAL),
        ({"phase": "Failed", "conditions": [_condition("Failed", "True", "InvalidSpec")]}, RESYNC_INTERVAL),
        ({"phase": "Succeeded", "completionTime": "2026-01-01T11:00:00Z"}, RESYNC_INTERVAL),  # no TTL
        ({}, RESYNC_INTERVAL),
    ],
)
def test_the_poll_interval_only_while_the_ray_job_may_move(status, expected):
    body = {"spec": spec_dict()}
    assert seconds_until_next_round(body, status, poll_interval=POLL, now=NOW) == expected


@pytest.mark.parametrize(
    "finished_ago, ttl, expected",
    [
        (2, 10, 8 + TTL_SLACK_SECONDS),  # wakes just after the TTL ends, so the round deletes it
        (20, 10, TTL_SLACK_SECONDS),  # overdue (an operator that was away): at once
        (0, 3600, RESYNC_INTERVAL),  # far off: the resync comes first
    ],
)
def test_a_finished_rljob_wakes_when_its_ttl_ends(finished_ago, ttl, expected):
    body = {"spec": spec_dict(ttlSecondsAfterFinished=ttl)}
    done = (NOW - timedelta(seconds=finished_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = {"phase": "Succeeded", "completionTime": done}
    assert seconds_until_next_round(body, status, poll_interval=POLL, now=NOW) == pytest.approx(expected)


# --- which RLJob an event wakes --------------------------------------------------------------------


def test_children_wake_their_rljob_by_cluster_name_or_label_and_nothing_else():
    async def scenario():
        wakeups = Wakeups()
        long_name = "a-" + "x" * 70  # cluster name and label value are shortened with a hash
        grpo, long_job = wakeups.add(("ns", "grpo")), wakeups.add(("ns", long_name))
        assert wakeups.child_changed("ns", cluster="grpo", rljob_label=None) == [("ns", "grpo")]
        assert grpo.is_set() and not long_job.is_set()
        grpo.clear()
        assert wakeups.child_changed("other", cluster="grpo", rljob_label="grpo") == []  # namespaced
        assert wakeups.child_changed("ns", cluster="someone-elses", rljob_label=None) == []
        assert wakeups.child_changed("ns", cluster=naming.ray_cluster_name(long_name), rljob_label=None) == [
            ("ns", long_name)
        ]
        long_job.clear()
        assert wakeups.child_changed("ns", cluster=None, rljob_label=naming.label_value(long_name)) == [
            ("ns", long_name)
        ]
        wakeups.remove(("ns", "grpo"), grpo)
        assert wakeups.child_changed("ns", cluster="grpo", rljob_label="grpo") == [] and len(wakeups) == 1
        newer = wakeups.add(("ns", long_name))  # a restarted daemon: the older one's exit keeps it
        wakeups.remove(("ns", long_name), long_job)
        assert (
            wakeups.child_changed("ns", cluster=None, rljob_label=naming.label_value(long_name)) == [("ns", long_name)]
            and newer.is_set()
        )

    asyncio.run(scenario())


def test_only_a_new_generation_of_the_rljob_wakes_it_not_its_own_status_writes():
    async def scenario():
        wakeups = Wakeups()
        wake = wakeups.add(("ns", "grpo"))
        wakeups.saw_generation(("ns", "grpo"), 1)
        assert not wakeups.rljob_changed(("ns", "grpo"), 1) and not wake.is_set()  # status, annotations
        assert wakeups.rljob_changed(("ns", "grpo"), 2) and wake.is_set()  # a spec edit
        assert not wakeups.rljob_changed(("ns", "unknown"), 5)  # no daemon (yet): it starts with a round

    asyncio.run(scenario())


# --- the daemon ------------------------------------------------------------------------------------


class _Stopped:
    """A TEST DOUBLE of kopf's `stopped` flag of a daemon."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    def wait(self):
        return self.event.wait()


class _CountingReconciler:
    """A TEST DOUBLE of Reconciler: counts rounds, checks they never overlap, answers `phase`."""

    metrics = None

    def __init__(self, phase: str = "Provisioning", *, fail: bool = False, seconds: float = 0.0) -> None:
        self.phase, self.fail, self.seconds = phase, fail, seconds
        self.rounds, self.running, self.overlapped = 0, 0, False
        self.lock = threading.Lock()

    def reconcile(self, body):
        with self.lock:
            self.running += 1
            self.overlapped |= self.running > 1
        try:
            time.sleep(self.seconds)
            self.rounds += 1
            if self.fail:
                raise ApiException(status=500, reason="etcd leader changed")
            return Outcome(status={"phase": self.phase})
        finally:
            with self.lock:
                self.running -= 1

    def write_status(self, body, status):
        return []


def _body(generation: int = 1) -> kopf.Body:
    return kopf.Body(
        {
            "apiVersion": "rldock.io/v1alpha1",
            "kind": "RLJob",
            "metadata": {"name": "grpo", "namespace": "ns", "uid": "u1", "generation": generation},
            "spec": spec_dict(),
        }
    )


async def _run_daemon(reconciler, poll_interval: float, script) -> None:
    handlers = Handlers(OperatorSettings(poll_interval=poll_interval))
    stopped = _Stopped()
    task = asyncio.create_task(
        handlers.rounds(
            body=_body(), memo=kopf.Memo(reconciler=reconciler), logger=logging.getLogger("test"), stopped=stopped
        )
    )
    try:
        await script(handlers)
    finally:
        stopped.event.set()
        await asyncio.wait_for(task, timeout=5)  # a stopped daemon exits after its round
    assert len(handlers.wakeups) == 0


async def _until(what: str, condition, timeout: float = 5.0) -> None:
    """Wait until `condition()` holds; a loaded machine may be slow, never wrong."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        await asyncio.sleep(0.02)


def test_an_idle_rljob_is_not_polled_and_a_child_event_runs_a_round_at_once():
    reconciler = _CountingReconciler("Provisioning")  # a cluster that is not up: the resync applies

    async def script(handlers):
        await _until("first round", lambda: reconciler.rounds == 1)
        await asyncio.sleep(1.0)  # five poll intervals
        assert reconciler.rounds == 1
        await handlers.pod_event(
            body={"metadata": {"namespace": "ns", "name": "grpo-head-x", "labels": {"ray.io/cluster": "grpo"}}}
        )
        await _until("a round after the pod's event", lambda: reconciler.rounds == 2)
        await handlers.ray_cluster_event(body={"metadata": {"namespace": "ns", "name": "grpo"}})
        await _until("a round after the RayCluster's event", lambda: reconciler.rounds == 3)
        await handlers.rljob_event(body=_body(generation=1), type="MODIFIED")  # its own status write
        await asyncio.sleep(0.5)
        assert reconciler.rounds == 3
        await handlers.rljob_event(body=_body(generation=2), type="MODIFIED")  # a spec edit
        await _until("a round after the spec edit", lambda: reconciler.rounds == 4)
        deployment = {"namespace": "ns", "name": "grpo-env-a", "labels": {"rldock.io/rljob": "grpo"}}
        await handlers.environment_event(body={"metadata": deployment})  # an environment's pod got ready
        await _until("a round after the environment's event", lambda: reconciler.rounds == 5)

    asyncio.run(_run_daemon(reconciler, 0.2, script))


def test_a_running_rljob_is_polled_at_the_poll_interval_and_rounds_never_overlap():
    reconciler = _CountingReconciler("Running", seconds=0.05)

    async def script(handlers):
        await _until("rounds at the poll interval, with no event", lambda: reconciler.rounds >= 4)
        for _ in range(10):  # events during rounds queue one more round, never a second at once
            await handlers.ray_cluster_event(body={"metadata": {"namespace": "ns", "name": "grpo"}})
            await asyncio.sleep(0.05)

    asyncio.run(_run_daemon(reconciler, 0.2, script))
    assert not reconciler.overlapped


def test_a_round_that_hits_an_api_error_is_retried_at_the_poll_interval_without_raising():
    reconciler = _CountingReconciler("Pending", fail=True)  # an idle phase would wait for the resync

    async def script(handlers):
        await _until("retries at the poll interval", lambda: reconciler.rounds >= 3)

    asyncio.run(_run_daemon(reconciler, 0.2, script))


# --- metrics ---------------------------------------------------------------------------------------


class _RecordingMetrics:
    """A TEST DOUBLE of metrics.Metrics: the calls the handlers make."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def reconciled(self, *, seconds, error):
        self.calls.append(("reconciled", error))
        assert seconds >= 0

    def set_phase(self, namespace, name, phase):
        self.calls.append(("set_phase", namespace, name, phase))

    def progress_seen(self, namespace, name):
        self.calls.append(("progress_seen", namespace, name))

    def mismatch_seen(self, namespace, name, kl):
        self.calls.append(("mismatch_seen", namespace, name, kl))

    def forget(self, namespace, name):
        self.calls.append(("forget", namespace, name))


class _AnsweringReconciler:
    """A TEST DOUBLE of Reconciler whose round answers `status`, or raises `error`."""

    def __init__(self, status=None, error=None) -> None:
        self.metrics = _RecordingMetrics()
        self.status, self.error, self.written = status, error, []

    def reconcile(self, body):
        if self.error is not None:
            raise self.error
        return Outcome(status=self.status)

    def write_status(self, body, status):
        self.written.append(status)
        return []


def _raw(status: dict) -> dict:
    return {
        "apiVersion": "rldock.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "grpo", "namespace": "ns", "uid": "u1"},
        "status": status,
    }


def test_a_round_reports_its_result_phase_and_new_progress_to_the_metrics():
    reconciler = _AnsweringReconciler(status={"phase": "Running", "iteration": 3})
    status = reconcile(_raw({"phase": "Running", "iteration": 2}), reconciler, logging.getLogger("test"))
    assert status == {"phase": "Running", "iteration": 3} and reconciler.written == [status]
    assert reconciler.metrics.calls == [
        ("reconciled", None),
        ("set_phase", "ns", "grpo", "Running"),
        ("progress_seen", "ns", "grpo"),
    ]

    same = _AnsweringReconciler(status={"phase": "Running", "iteration": 3})  # no new progress line
    reconcile(_raw({"phase": "Running", "iteration": 3}), same, logging.getLogger("test"))
    assert same.metrics.calls == [("reconciled", None), ("set_phase", "ns", "grpo", "Running")]
    assert same.written == []  # unchanged: no patch


def test_a_round_reports_the_rljob_s_mismatch_to_the_metrics_where_it_has_one():
    reconciler = _AnsweringReconciler(status={"phase": "Running", "iteration": 3, "rolloutMismatchKl": 0.02})
    reconcile(_raw({"phase": "Running", "iteration": 2}), reconciler, logging.getLogger("test"))
    assert reconciler.metrics.calls[-1] == ("mismatch_seen", "ns", "grpo", 0.02)


@pytest.mark.parametrize(
    "error, reason",
    [
        (ApiException(status=500, reason="etcd leader changed"), "http_500"),
        (urllib3.exceptions.MaxRetryError(None, "/", "connection refused"), "unreachable"),
    ],
)
def test_a_round_that_fails_is_counted_with_its_reason_and_keeps_the_phase(error, reason):
    reconciler = _AnsweringReconciler(error=error)
    assert reconcile(_raw({"phase": "Provisioning"}), reconciler, logging.getLogger("test")) is None
    assert reconciler.metrics.calls == [("reconciled", reason), ("set_phase", "ns", "grpo", "Provisioning")]


def test_a_deleted_rljob_is_forgotten_by_the_metrics():
    reconciler = _AnsweringReconciler()
    reconciler.stop_for_deletion = lambda body: None
    cleanup(
        body=kopf.Body(_raw({"phase": "Running"})),
        memo=kopf.Memo(reconciler=reconciler),
        logger=logging.getLogger("test"),
    )
    assert reconciler.metrics.calls == [("forget", "ns", "grpo")]


# --- garbage in kopf's annotations, and a deletion that must not hang ---------------------------

DIFFBASE = "rldock.io/last-handled-configuration"


def _rljob(annotations: dict) -> kopf.Body:
    return kopf.Body({"metadata": {"name": "grpo", "namespace": "ns", "annotations": annotations}})


@pytest.mark.parametrize(
    "value, expected",
    [
        ('{"spec": {"suspend": true}}', {"spec": {"suspend": True}}),  # what kopf wrote
        ("{not json", None),  # before: JSONDecodeError on every event; never reconciled, deletion hung
        ('"a string"', None),  # parses, but kopf then calls .get on it
        ("[1, 2]", None),
        ("", None),
    ],
)
def test_kopf_annotations_that_do_not_parse_count_as_absent(value, expected):
    storages = configure_kopf(kopf.OperatorSettings(), OperatorSettings()).persistence
    assert isinstance(storages.diffbase_storage, TolerantDiffBaseStorage)
    assert storages.diffbase_storage.fetch(body=_rljob({DIFFBASE: value})) == expected
    assert isinstance(storages.progress_storage, TolerantProgressStorage)
    assert storages.progress_storage.fetch(key="cleanup", body=_rljob({"rldock.io/cleanup": value})) == expected


class _FailingReconciler:
    metrics = None

    def stop_for_deletion(self, body):
        raise ApiException(status=500, reason="etcd leader changed")


def test_cleanup_never_raises_so_the_finalizer_comes_off():
    memo = kopf.Memo(reconciler=_FailingReconciler())
    cleanup(body=_rljob({}), memo=memo, logger=logging.getLogger("test"))  # before: raised, retried
