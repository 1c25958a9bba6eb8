"""Context parallelism composed with expert parallelism on the npu twin: two processes on npu:0 / npu:1,
CP 2 x EP 2 (one data-parallel rank, its CP group also its EP group), exchange heads (Ulysses) and
tokens (the experts' dispatch) through the twin's host-staged all-to-all, and their float64 logprobs,
losses (the router's term included) and gradients equal one process's on the host, on a packed batch
replaying a random routing and a padded one without (the tolerance as in
tests/ranks/test_context_expert_parallel_ranks.py: reassociation only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from twin_ranks import run_ranks

from rldock_e2e.moe_fixture import cp_batch, cp_moe_model, scored_with_router_loss

RANK_SCRIPT = Path(__file__).with_name("twin_cpep_rank.py")
WORLD = 2
TOL = dict(rtol=1e-9, atol=1e-12)


def test_cp2_x_ep2_on_two_twin_devices_equals_one_process(npu_twin, tmp_path):
    run_ranks(RANK_SCRIPT, WORLD, tmp_path)

    got = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    assert [g["device"] for g in got] == [f"npu:{rank}" for rank in range(WORLD)]
    assert list(got[0]["cases"]) == [("packed", True), ("padded", False)]
    for layout, replay in got[0]["cases"]:
        model = cp_moe_model()
        want = scored_with_router_loss(model, cp_batch(10), layout, replay=replay)
        for rank in range(WORLD):  # both CP ranks hold the whole batch's scores and loss
            case = got[rank]["cases"][layout, replay]
            torch.testing.assert_close(case["logprobs"], want["logprobs"], **TOL)
            assert case["loss"] == pytest.approx(want["loss"], rel=1e-9)
            for name, param in model.named_parameters():
                torch.testing.assert_close(case["grads"][name], param.grad, **TOL, msg=f"{layout} {replay} {name}")
