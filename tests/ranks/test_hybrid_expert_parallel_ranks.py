"""HSDP (replicate 2 x shard 2) beside EP 2 on 4 real gloo ranks (torch.multiprocessing, CPU): the actor's
FsdpBackend at data_parallel_size 4, data_parallel_replicate_size 2 and expert_parallel_size 2 on the tiny
Qwen3-MoE. The dense weights are sharded within each replica's 2 ranks and replicated over the two replicas
(FSDP2 on the (dp_replicate, dp_shard_cp) mesh); each EP group ({0, 1}, {2, 3}) splits the 8 experts, and
FSDP shards each rank's experts over its expert-data-parallel ranks ({0, 2}, {1, 3}), which span the
replicas. Each rank trains on its own rows: its logprobs are one process's, and every gradient (the
experts' gathered over the EP group) is one process's over the whole batch, the mean of the ranks' losses.

Float64, so the comparison measures the layout (the same sums cut differently), at 1e-9 on any CPU and
thread count; a gradient averaged over one replica only is off by the other replica's rows.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist

from rldock.runtime.planning.dtypes import DTYPE_BYTES
from rldock.runtime.planning.shapes import shape_from_hf_config
from rldock.runtime.planning.training_state import training_state_bytes
from rldock_e2e.moe_fixture import ROWS_PER_RANK, ep_job_config, token_logprobs, whole_batch, whole_gradients
from rldock_e2e.moe_fixture import moe_model as _model

pytestmark = pytest.mark.ranks

TOL = dict(rtol=1e-9, atol=1e-12)
WORLD, REPLICAS, EP = 4, 2, 2
DENSE = "model.layers.0.self_attn.q_proj.weight"


def _cfg():
    cfg = ep_job_config(WORLD, EP)
    return cfg.model_copy(
        update={"training": cfg.training.model_copy(update={"data_parallel_replicate_size": REPLICAS})}
    )


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    backend = FsdpBackend(
        _cfg(),
        model=_model(),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        device=detect_device("cpu"),
        rank=rank,
    )
    dense = dict(backend.model.named_parameters())[DENSE]
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    logprobs = token_logprobs(backend.model, whole_batch(WORLD)[rows])
    loss = -logprobs.mean()
    loss.backward()
    torch.save(
        {
            "logprobs": logprobs.detach(),
            "loss": float(loss.detach()),
            "grads": whole_gradients(backend),
            "dense_mesh": tuple(dense.device_mesh.shape),
            "dense_placements": [type(p).__name__ for p in dense.placements],
            "ep_group": dist.get_process_group_ranks(backend.experts.sharding.group),
            # the elements this rank holds of every parameter (a DTensor's local shard)
            "held": sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in backend.model.parameters()),
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.barrier()
    dist.destroy_process_group()


def test_hsdp_beside_ep_gives_one_process_s_logprobs_and_gradients(tmp_path):
    rank_processes.spawn(_rank, args=(f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex}", str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    assert [r["dense_mesh"] for r in ranks] == [(REPLICAS, WORLD // REPLICAS)] * WORLD
    assert [r["dense_placements"] for r in ranks] == [["Replicate", "Shard"]] * WORLD
    assert [r["ep_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # The planner's training state, element for element: the experts over every replica's ranks, the rest
    # over one replica's (it counted the experts over one replica's ranks too: twice what a rank holds).
    cfg = _cfg()
    planned, _, _ = training_state_bytes(cfg, shape_from_hf_config(_model().config.to_dict(), name="tiny-moe"))
    assert [r["held"] for r in ranks] == [planned // DTYPE_BYTES[cfg.model.dtype]] * WORLD

    model, batch = _model(), whole_batch(WORLD)
    logprobs = token_logprobs(model, batch)
    loss = -logprobs.mean()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(
            got["logprobs"], logprobs[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK].detach(), **TOL
        )
        assert got["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, **TOL, msg=name)
    assert sum(r["loss"] for r in ranks) / WORLD == pytest.approx(float(loss.detach()), rel=1e-12)
