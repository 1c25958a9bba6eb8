"""Routing replay under expert parallelism on real gloo ranks (torch.multiprocessing, CPU): two EP ranks
(FSDP 2, EP 2) replaying a recorded routing after the routers moved give the single process's replayed
logprobs, loss and gradients, so the all-to-all dispatch follows the replayed experts.

Tolerance as tests/ranks/test_expert_parallel_ranks.py's: float64, the ranks and one process run the
same operations grouped differently (reassociation only), rtol 1e-9. The replayed experts are integers
from one record, so no routing can flip between them."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist

from rldock_e2e.moe_fixture import ROWS_PER_RANK, ep_job_config, token_logprobs, whole_batch, whole_gradients
from rldock_e2e.moe_fixture import moe_model as _model

pytestmark = pytest.mark.ranks

TOL = dict(rtol=1e-9, atol=1e-12)
WORLD = 2


def _moved_model():
    """The fixture's model after its routers moved: each router redrawn (seed 7, std 0.5)."""
    from rldock.runtime.models.moe import routers

    model = _model()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for gate in routers(model):
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen, dtype=gate.weight.dtype) * 0.5)
    return model


def _replayed(model, tokens: torch.Tensor, recorded: torch.Tensor):
    """Token logprobs (b, L-1) of `tokens` (b, L) under `model`, routed by `recorded` (b, L, layers, k)."""
    from rldock.runtime.models.routing_replay import padded_pass_cells, replaying_routes

    rows, length = tokens.shape
    with replaying_routes(model, recorded) as replay:
        cells = padded_pass_cells(
            torch.arange(rows), prompt_start=0, attention_mask=torch.ones_like(tokens), row_width=length
        )
        replay.begin_pass(cells)
        logprobs = token_logprobs(model, tokens)
    return logprobs, replay


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    backend = FsdpBackend(
        ep_job_config(WORLD, WORLD),
        model=_moved_model(),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        device=detect_device("cpu"),
        rank=rank,
    )
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    recorded = torch.load(Path(out_dir) / "recorded.pt")[rows]
    logprobs, replay = _replayed(backend.model, whole_batch(WORLD)[rows], recorded)
    loss = -logprobs.mean()
    loss.backward()
    grads = whole_gradients(backend)
    torch.save(
        {"logprobs": logprobs.detach(), "loss": float(loss.detach()), "grads": grads, "changed": replay.changed},
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def test_expert_parallel_replay_equals_one_process(tmp_path):
    from rldock.runtime.models.routing_replay import padded_pass_cells, recording_routes

    batch = whole_batch(WORLD)  # (B, L)
    rows, length = batch.shape
    unmoved = _model()
    with torch.no_grad(), recording_routes(unmoved, num_rows=rows, row_width=length) as record:
        ones = torch.ones_like(batch)
        record.begin_pass(padded_pass_cells(torch.arange(rows), prompt_start=0, attention_mask=ones, row_width=length))
        token_logprobs(unmoved, batch)
    recorded = record.routed_experts()  # (B, L, layers, k), the unmoved routers' choice
    torch.save(recorded, tmp_path / "recorded.pt")
    rank_processes.spawn(_rank, args=(f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex}", str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    model = _moved_model()
    logprobs, replay = _replayed(model, batch, recorded)
    loss = -logprobs.mean()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    with torch.no_grad():  # without replay the moved routers route otherwise: the logprobs differ
        assert not torch.allclose(token_logprobs(_moved_model(), batch), logprobs, **TOL)
    assert replay.changed > 0 and sum(r["changed"] for r in ranks) == replay.changed
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(
            got["logprobs"], logprobs[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK].detach(), **TOL
        )
        assert got["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, **TOL, msg=name)
    assert sum(r["loss"] for r in ranks) / WORLD == pytest.approx(float(loss.detach()), rel=1e-12)
