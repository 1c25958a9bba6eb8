"""The dock round-trip benchmark's summary (no Ray): medians per call and client, and their ratio."""

from __future__ import annotations

from rldock_benchmarks.dock_round_trip import summarize


def test_summary_gives_medians_per_call_and_the_colocated_over_warehouse_actors_ratio():
    seconds = {
        "colocated": {"reset": [0.001, 0.002, 0.003], "put": [0.002, 0.002, 0.009], "get": [0.001, 0.004, 0.002]},
        "warehouse_actors": {
            "reset": [0.002, 0.002, 0.002],
            "put": [0.003, 0.003, 0.003],
            "get": [0.004, 0.004, 0.001],
        },
    }
    out = summarize(seconds)
    assert out["colocated"]["put"] == {"median_ms": 2.0, "p90_ms": 7.6, "mean_ms": 4.333, "count": 3}
    assert out["colocated_over_warehouse_actors_median"] == {"reset": 1.0, "put": 0.667, "get": 0.5}
