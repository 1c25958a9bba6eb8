"""Expert parallelism on the npu twin: two processes on npu:0 / npu:1 dispatch tokens to each other's
experts through the twin's host-staged all-to-all, and their float64 logprobs and gradients equal one
process's on the host over the whole batch (the tolerance as in
tests/ranks/test_expert_parallel_ranks.py: reassociation only)."""

from __future__ import annotations

from pathlib import Path

import torch
from twin_ranks import run_ranks

from rldock_e2e.moe_fixture import ROWS_PER_RANK, moe_model, token_logprobs, whole_batch

RANK_SCRIPT = Path(__file__).with_name("twin_ep_rank.py")
WORLD = 2
TOL = dict(rtol=1e-9, atol=1e-12)


def test_ep2_on_two_twin_devices_equals_one_process(npu_twin, tmp_path):
    run_ranks(RANK_SCRIPT, WORLD, tmp_path)

    model = moe_model()
    expected = token_logprobs(model, whole_batch(WORLD))
    (-expected.mean()).backward()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["device"] == f"npu:{rank}"
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        torch.testing.assert_close(got["logprobs"], expected[rows].detach(), **TOL)
        for name, param in model.named_parameters():
            torch.testing.assert_close(got["grads"][name], param.grad, **TOL, msg=name)
