"""The operator's metrics, read back as Prometheus would: a scrape parsed with prometheus_client's
parser, over HTTP from HealthServer and straight from the registry."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rldock.operator.constants import Phase
from rldock.operator.metrics import HealthServer, Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scrape(metrics: Metrics) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Sample name -> {sorted labels: value} of one scrape."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def metrics(clock: Clock) -> Metrics:
    return Metrics(clock=clock)


def test_every_phase_is_exported_with_zero_when_no_rljob_has_it(metrics: Metrics):
    phases = scrape(metrics)["rldock_rljobs"]
    assert phases == {(("phase", p.value),): 0.0 for p in Phase}
    assert scrape(metrics)["rldock_leader"] == {(): 0.0}


def test_rljobs_are_counted_by_their_latest_phase_and_forgotten(metrics: Metrics):
    metrics.set_phase("a", "one", "Running")
    metrics.set_phase("a", "two", "Running")
    metrics.set_phase("b", "one", "Pending")
    metrics.set_phase("a", "two", "Succeeded")  # a phase replaces the previous one
    metrics.set_phase("a", "three", "NoSuchPhase")  # not counted anywhere
    phases = {dict(k)["phase"]: v for k, v in scrape(metrics)["rldock_rljobs"].items()}
    assert phases == {**{p.value: 0.0 for p in Phase}, "Running": 1.0, "Pending": 1.0, "Succeeded": 1.0}
    metrics.set_phase("a", "one", None)
    metrics.forget("b", "one")
    phases = {dict(k)["phase"]: v for k, v in scrape(metrics)["rldock_rljobs"].items()}
    assert phases["Running"] == 0.0 and phases["Pending"] == 0.0 and phases["Succeeded"] == 1.0


def test_progress_age_grows_between_scrapes_and_only_for_running_rljobs(metrics: Metrics, clock: Clock):
    metrics.set_phase("ns", "job", "Running")  # no progress line yet: the age counts from here
    clock.now += 7
    ages = scrape(metrics)["rldock_rljob_last_progress_age_seconds"]
    assert ages == {(("namespace", "ns"), ("rljob", "job")): 7.0}
    metrics.progress_seen("ns", "job")
    clock.now += 2.5
    assert scrape(metrics)["rldock_rljob_last_progress_age_seconds"] == {(("namespace", "ns"), ("rljob", "job")): 2.5}
    metrics.set_phase("ns", "job", "Running")  # a later round in the same phase keeps the time
    assert scrape(metrics)["rldock_rljob_last_progress_age_seconds"][(("namespace", "ns"), ("rljob", "job"))] == 2.5
    metrics.set_phase("ns", "job", "Succeeded")
    assert "rldock_rljob_last_progress_age_seconds" not in scrape(metrics)
    metrics.forget("ns", "job")
    metrics.set_phase("ns", "job", "Running")  # a new RLJob of the same name starts from now
    assert scrape(metrics)["rldock_rljob_last_progress_age_seconds"][(("namespace", "ns"), ("rljob", "job"))] == 0.0


def test_the_mismatch_is_exported_for_running_rljobs_that_measure_it(metrics: Metrics):
    metrics.set_phase("ns", "job", "Running")
    metrics.set_phase("ns", "other", "Running")
    assert scrape(metrics).get("rldock_rljob_rollout_mismatch_kl", {}) == {}  # none measured yet
    metrics.mismatch_seen("ns", "job", 0.0123)
    assert scrape(metrics)["rldock_rljob_rollout_mismatch_kl"] == {(("namespace", "ns"), ("rljob", "job")): 0.0123}
    metrics.set_phase("ns", "job", "Failed")
    assert "rldock_rljob_rollout_mismatch_kl" not in scrape(metrics)
    metrics.forget("ns", "job")
    metrics.set_phase("ns", "job", "Running")  # a new RLJob of the same name has measured nothing yet
    assert "rldock_rljob_rollout_mismatch_kl" not in scrape(metrics)


def test_reconciles_errors_and_durations(metrics: Metrics):
    assert scrape(metrics)["rldock_reconciles_total"] == {(("result", "success"),): 0.0, (("result", "error"),): 0.0}
    metrics.reconciled(seconds=0.02, error=None)
    metrics.reconciled(seconds=0.3, error=None)
    metrics.reconciled(seconds=4.0, error="ApiException")
    samples = scrape(metrics)
    assert samples["rldock_reconciles_total"] == {(("result", "success"),): 2.0, (("result", "error"),): 1.0}
    assert samples["rldock_reconcile_errors_total"] == {(("reason", "ApiException"),): 1.0}
    assert samples["rldock_reconcile_duration_seconds_count"] == {(): 3.0}
    assert samples["rldock_reconcile_duration_seconds_sum"][()] == pytest.approx(4.32)
    buckets = samples["rldock_reconcile_duration_seconds_bucket"]
    assert buckets[(("le", "0.025"),)] == 1.0 and buckets[(("le", "0.5"),)] == 2.0
    assert buckets[(("le", "+Inf"),)] == 3.0


def test_jobs_api_requests_by_endpoint_and_outcome(metrics: Metrics):
    metrics.jobs_api_request(endpoint="get_job", seconds=0.01, outcome="ok")
    metrics.jobs_api_request(endpoint="get_job", seconds=5.0, outcome="timeout")
    metrics.jobs_api_request(endpoint="log_tail", seconds=0.2, outcome="ok")
    counts = scrape(metrics)["rldock_ray_jobs_api_request_duration_seconds_count"]
    assert counts == {
        (("endpoint", "get_job"), ("outcome", "ok")): 1.0,
        (("endpoint", "get_job"), ("outcome", "timeout")): 1.0,
        (("endpoint", "log_tail"), ("outcome", "ok")): 1.0,
    }


def test_two_metrics_objects_share_nothing(clock: Clock):
    first, second = Metrics(clock=clock), Metrics(clock=clock)
    first.reconciled(seconds=0.1, error=None)
    first.set_leader(True)
    assert scrape(second)["rldock_reconciles_total"][(("result", "success"),)] == 0.0
    assert scrape(second)["rldock_leader"] == {(): 0.0} and scrape(first)["rldock_leader"] == {(): 1.0}


@pytest.fixture
def server(metrics: Metrics) -> Iterator[HealthServer]:
    health = {"ok": True}
    served = HealthServer(metrics, port=0, host="127.0.0.1", healthy=lambda: health["ok"]).start()
    served.health = health  # type: ignore[attr-defined]
    yield served
    served.stop()


def _get(server: HealthServer, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


def test_the_server_serves_a_scrape_that_parses_and_health(server: HealthServer, metrics: Metrics):
    metrics.set_leader(True)
    metrics.set_phase("ns", "job", "Running")
    status, content_type, text = _get(server, "/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {
        "rldock_reconciles",
        "rldock_reconcile_errors",
        "rldock_reconcile_duration_seconds",
        "rldock_rljobs",
        "rldock_rljob_last_progress_age_seconds",
        "rldock_ray_jobs_api_request_duration_seconds",
        "rldock_leader",
        "process_cpu_seconds",
        "process_resident_memory_bytes",
    } <= families.keys()
    running = [s for s in families["rldock_rljobs"].samples if s.labels["phase"] == "Running"]
    assert [s.value for s in running] == [1.0]
    assert _get(server, "/readyz")[0] == 200 and _get(server, "/healthz")[0] == 200
    server.health["ok"] = False  # type: ignore[attr-defined]
    assert _get(server, "/healthz")[0] == 503
    assert _get(server, "/readyz")[0] == 200  # a standby, or a leader: ready while it serves
    assert _get(server, "/other")[0] == 404
