"""The partial-rollout benchmark's configs (no jobs run): each mode is a valid async job on the
throughput benchmark's generation-heavy and early-stopping shapes, cut where the benchmark says."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldock_benchmarks.partial_rollout import MODES, SHAPES, variant
from rldock_benchmarks.throughput import shape_config, shapes

MODELS = {"heavy": Path("/m/heavy"), "heavy_no_eos": Path("/m/heavy-no-eos")}


@pytest.mark.parametrize("quick", [False, True])
def test_modes_are_valid_async_jobs_cut_at_a_quarter(quick):
    selected = [s for s in shapes(quick) if s.name in SHAPES]
    assert [s.name for s in selected] == list(SHAPES)
    for shape in selected:
        sl = shape.overrides["algorithm"]["max_response_length"]
        cfgs = {mode: shape_config(shape, variant(mode, sl), iterations=3, models=MODELS) for mode in MODES}
        assert {(c.training.mode, c.dock.max_staleness) for c in cfgs.values()} == {("async", 1)}
        assert [c.rollout.partial_rollout for c in cfgs.values()] == list(MODES)
        assert [c.rollout.max_tokens_per_round for c in cfgs.values()] == [None, sl // 4, sl // 4]
