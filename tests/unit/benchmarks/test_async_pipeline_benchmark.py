"""The async benchmark's configs (no jobs run): each variant is a valid job of the mode it names,
on the throughput benchmark's demo and generation-heavy shapes."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldock.runtime.flow.job_recipe import job_recipe
from rldock_benchmarks.async_pipeline import SHAPES, VARIANTS
from rldock_benchmarks.throughput import shape_config, shapes

MODELS = {"heavy": Path("/m/heavy"), "heavy_no_eos": Path("/m/heavy-no-eos")}


@pytest.mark.parametrize("quick", [False, True])
def test_variants_run_the_modes_they_name(quick):
    selected = [s for s in shapes(quick) if s.name in SHAPES]
    assert [s.name for s in selected] == list(SHAPES)
    for shape in selected:
        cfgs = {name: shape_config(shape, variant, iterations=3, models=MODELS) for name, variant in VARIANTS.items()}
        assert [(c.training.mode, c.dock.max_staleness) for c in cfgs.values()] == [
            ("sync", 0),
            ("sync", 0),
            ("async", 1),
        ]
        # sync skips the old-logprob pass; the other two run it, so sync_recompute isolates the pipelining.
        passes = {name: "actor_inference" in job_recipe(cfg).consumes for name, cfg in cfgs.items()}
        assert passes == {"sync": False, "sync_recompute": True, "async": True}
