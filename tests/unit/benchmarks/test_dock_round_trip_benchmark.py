"""The dock round-trip benchmark's summary (no Ray): medians per call and client, and their ratio."""

from __future__ import annotations

from rldock_benchmarks.dock_round_trip import summarize


def test_summary_gives_medians_per_call_and_the_host_reads_over_two_calls_ratio():
    seconds = {
        "host_reads": {"reset": [0.001, 0.002, 0.003], "put": [0.002, 0.002, 0.009], "get": [0.001, 0.004, 0.002]},
        "two_calls": {"reset": [0.002, 0.002, 0.002], "put": [0.003, 0.003, 0.003], "get": [0.004, 0.004, 0.001]},
    }
    out = summarize(seconds)
    assert out["host_reads"]["put"] == {"median_ms": 2.0, "p90_ms": 7.6, "mean_ms": 4.333, "count": 3}
    assert out["host_reads_over_two_calls_median"] == {"reset": 1.0, "put": 0.667, "get": 0.5}
