"""The eq. 3 benchmark's measurement (rldock_benchmarks.moe_resharding) on the tiny MoE at FSDP 2 x EP 2 and at
PP 2 x FSDP 2 x EP 2: the training weights naive resharding leaves on the engines' ranks during generation are
the planner's figure (FSDP pads a shard to whole rows: within 0.1%), and at FSDP 2 x EP 2 allgather_swap leaves
none."""

from __future__ import annotations

import json

import pytest

from rldock.runtime.models import MODEL_BUILDERS
from rldock.runtime.planning.memory import plan_redundant_weights
from rldock.runtime.planning.shapes import shape_from_hf_config
from rldock_benchmarks.moe_resharding import TEXTS, job_config, measure

pytestmark = pytest.mark.integration


def test_naive_leaves_the_planned_weights_and_allgather_swap_none(tmp_path):
    path = tmp_path / "tiny-qwen3-moe"
    MODEL_BUILDERS.get("tiny-qwen3-moe")(path, texts=TEXTS, seed=0)
    shape = shape_from_hf_config(json.loads((path / "config.json").read_text()), name="tiny")
    planned = plan_redundant_weights(job_config(str(path), 2, 2, "naive"), shape)
    naive = measure(2, 2, "naive", str(path))
    assert naive["measured_R"] == pytest.approx(planned.naive_bytes, rel=1e-3)
    swapped = measure(2, 2, "allgather_swap", str(path))
    assert swapped["measured_R"] == 0 and swapped["grads_and_optimizer_on_engine_ranks"] == 0


def test_under_pp_each_engine_rank_keeps_its_stage_shard_as_planned(tmp_path):
    # PP 2 of 2 FSDP ranks each, EP 2 within a stage: every rank an engine's, holding its stage's shard
    path = tmp_path / "tiny-qwen3-moe"
    MODEL_BUILDERS.get("tiny-qwen3-moe")(path, texts=TEXTS, seed=0)
    shape = shape_from_hf_config(json.loads((path / "config.json").read_text()), name="tiny")
    planned = plan_redundant_weights(job_config(str(path), 4, 2, "naive", 2), shape)
    naive = measure(4, 2, "naive", str(path), 2)
    assert naive["engine_ranks"] == [0, 1, 2, 3]
    assert naive["measured_R"] == pytest.approx(planned.naive_bytes, rel=1e-3)
