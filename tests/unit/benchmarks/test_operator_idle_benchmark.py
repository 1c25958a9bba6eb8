"""rldock_benchmarks.operator_idle's pure parts: how the API server's audit events are counted and
what the target asks (the measurement itself needs the control plane: tests/integration/
test_operator_events.py runs it)."""

from __future__ import annotations

from rldock_benchmarks.operator_idle import TARGET_CORE_SHARE, count_requests, within_target


def event(verb: str, resource: str, subresource: str | None = None) -> dict:
    ref = {"resource": resource, "namespace": "idle-1", **({"subresource": subresource} if subresource else {})}
    return {"verb": verb, "objectRef": ref, "user": {"username": "developer"}}


def test_writes_reads_reviews_and_watches_are_counted_apart():
    counted = count_requests(
        [
            event("get", "configmaps"),
            event("list", "pods"),
            event("patch", "rljobs", "status"),
            event("create", "rayclusters"),
            event("delete", "rayclusters"),
            event("create", "localsubjectaccessreviews"),
            event("watch", "pods"),
            event("get", "configmaps"),
        ]
    )
    assert (counted["writes"], counted["reads"], counted["access_reviews"], counted["watches_ended"]) == (3, 3, 1, 1)
    assert counted["by_verb_and_resource"]["get configmaps"] == 2
    assert counted["by_verb_and_resource"]["patch rljobs/status"] == 1


def run(core_share: float, writes: int | None) -> dict:
    requests = None if writes is None else count_requests([event("patch", "rljobs", "status")] * writes)
    return {"core_share": core_share, "requests_in_window": requests}


def test_the_target_is_the_cpu_share_and_no_write_at_every_poll_interval():
    assert within_target([run(TARGET_CORE_SHARE, 0), run(0.001, None)])  # None: the requests not counted
    assert not within_target([run(0.001, 0), run(TARGET_CORE_SHARE * 1.5, 0)])
    assert not within_target([run(0.001, 1)])
