"""FSDP 2 x TP 2 on the npu twin: four processes on npu:0-3, the decoder layers' linears split over each TP
pair and sharded again over the data-parallel pair (2-D DTensors whose collectives run over the twin's
host-staged `hccl_twin`, the TP plan's scatter included), give one process's float64 logprobs, gradients
and gradient norm over the whole batch (reassociation only, as in
tests/ranks/test_fsdp_tensor_parallel_ranks.py; 1e-9 holds on any CPU, a missed per-head sum over TP
or a TP shard counted twice does not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from twin_fsdp_tp_rank import TP, qwen3
from twin_ranks import run_ranks

from rldock_e2e.moe_fixture import ROWS_PER_RANK, token_logprobs, whole_batch

RANK_SCRIPT = Path(__file__).with_name("twin_fsdp_tp_rank.py")
WORLD = 4
TOL = dict(rtol=1e-9, atol=1e-12)


def test_fsdp2_by_tp2_on_four_twin_devices_equals_one_process(npu_twin, tmp_path):
    run_ranks(RANK_SCRIPT, WORLD, tmp_path)

    model = qwen3()
    expected = token_logprobs(model, whole_batch(WORLD // TP))
    (-expected.mean()).backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    norm = float(torch.nn.utils.get_total_norm(list(grads.values())))
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["device"] == f"npu:{rank}" and got["dp_rank"] == rank // TP
        assert got["placements"]["model.layers.0.self_attn.q_proj.weight"] == 2  # TP's shard, sharded by FSDP
        rows = slice(got["dp_rank"] * ROWS_PER_RANK, (got["dp_rank"] + 1) * ROWS_PER_RANK)
        torch.testing.assert_close(got["logprobs"], expected[rows].detach(), **TOL)
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, **TOL, msg=name)
        assert got["norm"] == pytest.approx(norm, rel=1e-9)
