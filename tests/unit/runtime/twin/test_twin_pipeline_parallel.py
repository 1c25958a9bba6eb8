"""PP 2 on the npu twin: two processes on npu:0 and npu:1, one pipeline stage each, whose activations and
their gradients cross the twin's host-staged `hccl_twin` sends and receives (batched with each other in the
1F1B schedule's steady state, as on HCCL), give one process's float64 logprobs (on the last stage), loss,
gradients and gradient norm over 4 micro-batches (reassociation only, as in
tests/ranks/test_pipeline_parallel_ranks.py: 1e-9 holds on any CPU; a stage that ran the wrong
layers or a lost activation gradient does not)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from twin_fsdp_tp_rank import qwen3
from twin_pp_rank import KEYS, weighted_logprobs
from twin_ranks import run_ranks

from rldock.runtime.engines.policy import response_logprobs
from rldock_e2e.scored_batch import scored_batch

RANK_SCRIPT = Path(__file__).with_name("twin_pp_rank.py")
WORLD = 2
TOL = dict(rtol=1e-9, atol=1e-12)


def test_pp2_on_two_twin_devices_equals_one_process(npu_twin, tmp_path):
    run_ranks(RANK_SCRIPT, WORLD, tmp_path)

    model = qwen3()
    batch = TensorDict(scored_batch(1, vocab_size=64), batch_size=[4])
    with torch.no_grad():
        expected_logprobs = response_logprobs(model, *(batch[k] for k in KEYS), micro_batch_size=4, trim=True)
    loss = 0.0
    for i in range(4):  # the same micro-batches, one after another
        micro = weighted_logprobs(model, batch[i : i + 1])
        micro.backward()
        loss += float(micro.detach())
    grads = {name: param.grad for name, param in model.named_parameters()}
    norm = float(torch.nn.utils.get_total_norm(list(grads.values())))
    got = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    assert [g["stage"] for g in got] == [0, 1] and [g["device"] for g in got] == ["npu:0", "npu:1"]
    torch.testing.assert_close(got[1]["logprobs"], expected_logprobs, **TOL)  # the last stage scores
    assert set(got[0]["grads"]) | set(got[1]["grads"]) == set(grads)
    for stage in got:
        assert stage["loss"] == pytest.approx(loss, rel=1e-9)
        assert stage["norm"] == pytest.approx(norm, rel=1e-9)
        for name, grad in stage["grads"].items():
            torch.testing.assert_close(grad, grads[name], **TOL, msg=name)
