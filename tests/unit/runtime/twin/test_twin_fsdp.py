"""The FSDP path (`training.strategy: fsdp`) on the npu twin: two processes, one rank each on npu:0 /
npu:1, joined through the product's init_process_group with the device seam's backend (npu tensors
over the twin's host-staged `hccl_twin`, host tensors over gloo) and sharded by the actor's
FsdpBackend. One step equals one process stepping on the whole batch, and during generation the
twin's allocator (not the ledger's arithmetic) holds none of the training state on either device."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from twin_fsdp_rank import tiny_model, whole_batch

RANK_SCRIPT = Path(__file__).with_name("twin_fsdp_rank.py")
WORLD = 2
STATE = ("train_params", "grads", "optimizer_state")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _single_process_step() -> tuple[dict[str, torch.Tensor], float]:
    """The same step in one process on the host over the whole batch: what the ranks must reproduce."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = whole_batch(WORLD)
    model(input_ids=batch, labels=batch).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}, norm


def test_fsdp_step_and_swap_on_two_twin_devices(npu_twin, tmp_path):
    port = _free_port()
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

    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    expected, norm = _single_process_step()
    for rank, got in enumerate(results):
        # Each rank's shards live on its own device, and the engine got whole weights from it.
        assert got["param_device"] == f"npu:{rank}" and got["pushed_devices"] == [f"npu:{rank}"]
        assert got["weights"].keys() == expected.keys()
        # AdamW's first step moves a weight by lr*g/(|g|+eps): where g is near eps the step depends on
        # summation order (two half batches here, threads differ), a wrong reduction moves it by ~lr.
        for name, tensor in expected.items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-4, atol=1e-4, msg=name)
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert torch.isfinite(torch.tensor(got["loss"]))

        # Measured by the twin's allocator on npu:rank: the swap takes exactly the training state off
        # the device; what stays are the model's buffers (rotary tables), which are not training state.
        ledger, prefix = got["ledger"], f"memory/rank{rank}"
        state_bytes = sum(ledger[f"{prefix}/after_update/{category}"] for category in STATE)
        assert state_bytes > 0 and ledger[f"{prefix}/generation/host_swap"] == state_bytes
        assert got["after_update"] == state_bytes + got["buffer_bytes"]
        assert got["during_generation"] - got["buffer_bytes"] == 0
        assert got["after_swap_in"] == got["after_update"]

    # Each rank holds about half the model: the two devices' shards add up to it.
    full_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    shards = [r["ledger"][f"memory/rank{i}/after_update/train_params"] for i, r in enumerate(results)]
    assert sum(shards) == pytest.approx(full_bytes, rel=0.05) and max(shards) <= 0.55 * full_bytes
