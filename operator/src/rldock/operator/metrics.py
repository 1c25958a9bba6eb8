"""The operator's Prometheus metrics, and the small HTTP server that serves them with its health.

Metrics (one registry per Metrics object, so tests and two operators in one process never share):

    rldock_reconciles_total{result="success"|"error"}          counter: reconcile rounds
    rldock_reconcile_errors_total{reason}                      counter: failed rounds, by reason
    rldock_reconcile_duration_seconds                          histogram: one round's duration
    rldock_rljobs{phase}                                       gauge: RLJobs per phase, every phase
                                                               of constants.Phase present (0 when none)
    rldock_rljob_last_progress_age_seconds{namespace, rljob}   gauge: seconds since a Running RLJob's
                                                               last new progress line (before its first:
                                                               since it was first seen Running)
    rldock_rljob_rollout_mismatch_kl{namespace, rljob}         gauge: a Running RLJob's last mismatch/kl
                                                               (status.rolloutMismatchKl), in a job that
                                                               measures it
    rldock_ray_jobs_api_request_duration_seconds{endpoint, outcome}
                                                               histogram: Ray Jobs API requests
                                                               (rayjobs.Endpoint, rayjobs.Outcome)
    rldock_leader                                              gauge: 1 on the replica that reconciles
    process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...
                                                               prometheus_client's ProcessCollector:
                                                               the operator's own cost

The RLJob gauges are computed at scrape time from what the handlers reported (set_phase,
progress_seen, forget), so an age keeps growing between rounds and a forgotten RLJob disappears.
Only the leader reconciles, so on a standby the RLJob metrics stay empty and rldock_leader is 0.

HealthServer serves GET /metrics (the Prometheus text format), /healthz (liveness) and /readyz
(readiness) on one port in every replica, leader or standby. It is the operator's own rather than
kopf's liveness endpoint because kopf's serves only once kopf runs, which a standby never does: a
standby would never turn Ready, and a rolling update (which waits for the new pod to be Ready)
would never finish.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rldock.operator.constants import Phase
from rldock.operator.serving import Reply, Request, Server

log = logging.getLogger(__name__)

RESULT_SUCCESS = "success"
RESULT_ERROR = "error"
# A round takes tens of milliseconds on a quiet cluster and up to the Jobs API deadline (5 s by
# default) on a slow head; requests to a head the same range.
DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

Key = tuple[str, str]  # (namespace, RLJob name)


class Metrics:
    """What the handlers and the Jobs API client report; `registry` is what a scrape reads."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._clock = clock
        self._lock = threading.Lock()
        self._phases: dict[Key, Phase] = {}
        self._progress: dict[Key, float] = {}  # clock() of the last new progress line, or of Running
        self._mismatch: dict[Key, float] = {}  # the last mismatch/kl a progress line carried
        self._reconciles = Counter(
            "rldock_reconciles", "Reconcile rounds, by result.", ["result"], registry=self.registry
        )
        self._errors = Counter(
            "rldock_reconcile_errors", "Reconcile rounds that failed, by reason.", ["reason"], registry=self.registry
        )
        self._duration = Histogram(
            "rldock_reconcile_duration_seconds",
            "Duration of one reconcile round.",
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._jobs_api = Histogram(
            "rldock_ray_jobs_api_request_duration_seconds",
            "Duration of Ray Jobs API requests, by endpoint and outcome.",
            ["endpoint", "outcome"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self._leader = Gauge(
            "rldock_leader", "1 on the operator replica that holds the lease and reconciles.", registry=self.registry
        )
        for result in (RESULT_SUCCESS, RESULT_ERROR):
            self._reconciles.labels(result=result)  # both series from the start, so rate() sees the first
        self.registry.register(_RLJobCollector(self))
        ProcessCollector(registry=self.registry)  # CPU seconds, memory, open files of this process

    # --- what the handlers report ---------------------------------------------------------------
    def reconciled(self, *, seconds: float, error: str | None) -> None:
        """One round took `seconds`; `error` names why it failed (a short reason), None: it did not."""
        self._duration.observe(seconds)
        if error is None:
            self._reconciles.labels(result=RESULT_SUCCESS).inc()
        else:
            self._reconciles.labels(result=RESULT_ERROR).inc()
            self._errors.labels(reason=error).inc()

    def set_phase(self, namespace: str, name: str, phase: str | None) -> None:
        """The RLJob's phase now; None forgets the RLJob (as `forget`). A phase this operator does
        not know is logged and leaves the RLJob uncounted."""
        key = (namespace, name)
        if phase is None:
            self.forget(namespace, name)
            return
        try:
            parsed = Phase(phase)
        except ValueError:
            log.warning("%s/%s: unknown phase %r not counted in rldock_rljobs", namespace, name, phase)
            return
        with self._lock:
            self._phases[key] = parsed
            if parsed is Phase.RUNNING:
                self._progress.setdefault(key, self._clock())  # the age counts from here until a first line

    def progress_seen(self, namespace: str, name: str) -> None:
        """The RLJob's driver printed a new progress line."""
        with self._lock:
            self._progress[(namespace, name)] = self._clock()

    def mismatch_seen(self, namespace: str, name: str, kl: float) -> None:
        """The RLJob's last train-inference mismatch (status.rolloutMismatchKl)."""
        with self._lock:
            self._mismatch[(namespace, name)] = kl

    def forget(self, namespace: str, name: str) -> None:
        """The RLJob is gone (deleted): drop its series."""
        with self._lock:
            self._phases.pop((namespace, name), None)
            self._progress.pop((namespace, name), None)
            self._mismatch.pop((namespace, name), None)

    # --- what the Jobs API client and the leader elector report ---------------------------------
    def jobs_api_request(self, *, endpoint: str, seconds: float, outcome: str) -> None:
        self._jobs_api.labels(endpoint=endpoint, outcome=outcome).observe(seconds)

    def set_leader(self, leading: bool) -> None:
        self._leader.set(1 if leading else 0)

    # --- a scrape ---------------------------------------------------------------------------------
    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)

    def _rljob_families(self) -> Iterator[Metric]:
        with self._lock:
            phases = dict(self._phases)
            progress = dict(self._progress)
            mismatch = dict(self._mismatch)
        now = self._clock()
        by_phase = GaugeMetricFamily("rldock_rljobs", "RLJobs known to this replica, by phase.", labels=["phase"])
        for phase in Phase:
            by_phase.add_metric([phase.value], sum(1 for p in phases.values() if p is phase))
        yield by_phase
        running = {key for key, phase in phases.items() if phase is Phase.RUNNING}
        yield _per_rljob(
            "rldock_rljob_last_progress_age_seconds",
            "Seconds since a Running RLJob's last new progress line (before its first: "
            "since it was first seen Running).",
            {key: max(0.0, now - seen) for key, seen in progress.items() if key in running},
        )
        yield _per_rljob(
            "rldock_rljob_rollout_mismatch_kl",
            "A Running RLJob's last train-inference mismatch, mismatch/kl (job.algorithm.rollout_correction or "
            "job.monitoring.mismatch measures it).",
            {key: kl for key, kl in mismatch.items() if key in running},
        )


def _per_rljob(name: str, documentation: str, values: dict[Key, float]) -> GaugeMetricFamily:
    """A gauge with one series per RLJob (`namespace`, `rljob` labels), in name order."""
    family = GaugeMetricFamily(name, documentation, labels=["namespace", "rljob"])
    for (namespace, rljob), value in sorted(values.items()):
        family.add_metric([namespace, rljob], value)
    return family


class _RLJobCollector(Collector):
    """The per-RLJob gauges, computed at each scrape."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics._rljob_families()

    def describe(self) -> Iterable[Metric]:
        return self._metrics._rljob_families()


class HealthServer:
    """GET /metrics, /healthz and /readyz on `port` (0: any free port, see `.port`), in a thread
    (serving.py).

    `healthy()` answers /healthz (False: 503, so the kubelet restarts the container); /readyz is
    200 whenever the process serves: a standby is ready, since it can take over at any moment.
    """

    def __init__(
        self, metrics: Metrics, *, port: int, host: str = "0.0.0.0", healthy: Callable[[], bool] = lambda: True
    ) -> None:
        def health(request: Request) -> Reply:
            ok = healthy()
            return Reply(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")

        routes = {
            ("GET", "/metrics"): lambda request: Reply(200, metrics.exposition(), CONTENT_TYPE_LATEST),
            ("GET", "/healthz"): health,
            ("GET", "/readyz"): lambda request: Reply(200, b"ok\n"),
        }
        # Probes every few seconds: requests are not logged.
        self._server = Server(routes, name="rldock-health", what="health server", port=port, host=host)
        self.port = self._server.port

    def start(self) -> HealthServer:
        self._server.start()
        log.info("serving /metrics, /healthz and /readyz on port %d", self.port)
        return self

    def stop(self) -> None:
        self._server.stop()
