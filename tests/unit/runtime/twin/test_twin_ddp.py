"""The DDP path on the npu twin: two processes, each a rank on its own npu device, joined through
the device seam's backend (npu tensors over the twin's host-staged gloo, host tensors over gloo)
and wrapped by the product's wrap_ddp: after one backward both hold the mean of their gradients.
(FSDP, `training.strategy: fsdp`, on the twin: test_twin_fsdp.py.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

RANK_SCRIPT = Path(__file__).with_name("twin_ddp_rank.py")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ddp_averages_gradients_across_twin_devices(npu_twin, tmp_path):
    port, world_size = _free_port(), 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the ranks import what this process does
    ranks = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), str(rank), str(world_size), str(port), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    for rank in ranks:
        output, _ = rank.communicate(timeout=300)
        assert rank.returncode == 0, output[-4000:]

    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]
    assert [r["grad_device"] for r in results] == ["npu:0", "npu:1"]
    for name, grad in results[0]["averaged"].items():
        expected = (results[0]["local"][name] + results[1]["local"][name]) / 2
        torch.testing.assert_close(grad, expected)
        torch.testing.assert_close(results[1]["averaged"][name], expected)
    assert not torch.equal(results[0]["local"]["0.weight"], results[1]["local"]["0.weight"])  # the data differed
    assert all(float(r["tokens"]) == 3.0 for r in results)
