"""The context-parallel benchmark on real gloo ranks at a small length: the all-to-all bytes each rank
sends equal the planner's to the byte, the bytes autograd saves per rank fall with CP as the planner
says within 10%, and every CP size computes the same loss (rldock_benchmarks.context_parallel)."""

import pytest

from rldock_benchmarks.context_parallel import run, summarize

pytestmark = pytest.mark.integration


def test_cp_ranks_exchange_the_planned_bytes_and_save_the_planned_share():
    report = summarize([run(cp, 256, 1) for cp in (1, 2, 4)])
    rows = {row["cp"]: row for row in report["rows"]}
    assert rows[1]["max_rank_all_to_all_bytes"] == 0
    for cp in (2, 4):
        assert rows[cp]["max_rank_all_to_all_bytes"] == rows[cp]["planned_all_to_all_bytes"] > 0
        assert rows[cp]["loss"] == pytest.approx(rows[1]["loss"], rel=1e-5)  # float32, summed in another order
        assert abs(rows[cp]["fall_vs_planned_error"]) <= 0.10, rows[cp]
        assert rows[cp]["saved_vs_cp1"] < 1.2 / cp
