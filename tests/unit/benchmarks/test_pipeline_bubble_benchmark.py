"""The pipeline-bubble benchmark on 2 real gloo ranks (rldock_benchmarks.pipeline_bubble): each stage's
step runs the 1F1B schedule through the FSDP backend, and the report gives the measured idle share beside
(p - 1) / (m + p - 1). Timing figures are the benchmark's to read (docs/scaling.md, section 12), not this
test's to bound: it checks what every run must hold."""

import pytest

from rldock_benchmarks.pipeline_bubble import measure

pytestmark = pytest.mark.integration


def test_each_row_measures_both_stages_beside_the_formula():
    rows = measure(2, [2, 4], steps=1)
    assert [(row["micro_batches"], row["expected_bubble"]) for row in rows] == [(2, 0.3333), (4, 0.2)]
    for row in rows:
        assert len(row["bubble_per_stage"]) == 2 and all(0 < bubble < 1 for bubble in row["bubble_per_stage"])
        # a stage computes for part of the step, never all of it
        assert all(0 < busy < row["step_seconds"] for busy in row["busy_seconds_per_stage"])
