"""Expert parallelism on the npu twin: two processes on npu:0 / npu:1 dispatch tokens to each other's
experts through the twin's host-staged all-to-all, and their float64 logprobs and gradients equal one
process's on the host over the whole batch (the tolerance as in
tests/integration/test_expert_parallel_ranks.py: reassociation only)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rldock_e2e.moe_fixture import ROWS_PER_RANK, moe_model, token_logprobs, whole_batch

RANK_SCRIPT = Path(__file__).with_name("twin_ep_rank.py")
WORLD = 2
TOL = dict(rtol=1e-9, atol=1e-12)


def test_ep2_on_two_twin_devices_equals_one_process(npu_twin, tmp_path):
    # This process holds the group's store on a port the OS picked and keeps it bound while the
    # ranks connect (a port probed free and bound later by a rank could be taken in between).
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False)
    port = store.port
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the ranks import what this process does
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(rank), str(WORLD), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    for rank in ranks:
        output, _ = rank.communicate(timeout=300)
        assert rank.returncode == 0, output[-4000:]

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
