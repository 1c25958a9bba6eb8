"""HSDP (replicate 2 x shard 2) x CP 2 on 8 real gloo ranks (torch.multiprocessing, CPU): the actor's
FsdpBackend at data_parallel_size 4, data_parallel_replicate_size 2 and context_parallel_size 2 shards
the model within each replica's 2 data-parallel x 2 CP ranks and replicates the shards over the two
replicas (FSDP2 on the training mesh's 2-D (dp_replicate, dp_shard_cp) mesh). Each data-parallel rank
trains on its own batch; every rank's logprobs are its batch's as one process scores them, and the
gradients are one process's mean over the four batches, on packed, padded and trimmed passes.

Float64 throughout, so the comparison measures the layout: the same sums cut differently (CP's positions,
the reduce-scatter within a replica, the all-reduce over replicas), a few ulps times the depth of the
sums; 1e-9 holds on any CPU and thread count, while a gradient averaged over one replica only, or summed
over both without the mean, is off by a factor of 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist
from test_context_parallel_ranks import TOLERANCE, _batch, _grads, _model, _scores_and_loss
from test_fsdp_ranks import _adamw, _cfg

from rldock_e2e.scored_batch import LAYOUTS

pytestmark = pytest.mark.ranks

WORLD, DP, CP, REPLICAS = 8, 4, 2, 2
WEIGHT = "model.layers.0.self_attn.q_proj.weight"


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    cfg = _cfg(devices=WORLD, data_parallel_size=DP, context_parallel_size=CP, data_parallel_replicate_size=REPLICAS)
    backend = FsdpBackend(cfg, model=_model(), make_optimizer=_adamw, device=detect_device("cpu"), rank=rank)
    weight = dict(backend.model.named_parameters())[WEIGHT]
    results: dict = {
        "dp_rank": backend.context.dp_rank,
        "fsdp_mesh": tuple(weight.device_mesh.shape),
        "placements": [type(p).__name__ for p in weight.placements],
        "local_rows": weight.to_local().shape[0],
    }
    for layout in LAYOUTS:
        backend.model.zero_grad()
        logprobs, _, loss = _scores_and_loss(backend.model, _batch(10 + backend.context.dp_rank), layout)
        loss.backward()
        results[layout] = dict(logprobs=logprobs.detach(), grads=_grads(backend.model))
    results["weights"] = dict(backend.full_state())  # what the engine and a checkpoint get (no step taken)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("hsdp-cp-ranks")
    # a file rendezvous in the test's own directory: a probed free port could be taken before rank 0 binds it
    rank_processes.spawn(_rank, args=(str(out_dir / "rendezvous"), str(out_dir)), nprocs=WORLD)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def test_each_replica_shards_over_its_data_parallel_by_cp_ranks(ranks):
    rows = _model().state_dict()[WEIGHT].shape[0]
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    for got in ranks:  # replicated over the 2 replicas, sharded over a replica's 4 ranks
        assert got["fsdp_mesh"] == (REPLICAS, DP // REPLICAS * CP)
        assert got["placements"] == ["Replicate", "Shard"]
        assert got["local_rows"] == rows // 4
        whole = _model().state_dict()  # gathered whole, in the Hugging Face names
        assert got["weights"].keys() == whole.keys()
        assert all(torch.equal(got["weights"][name], tensor) for name, tensor in whole.items())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hsdp_by_cp_gives_one_process_s_logprobs_and_mean_gradient(ranks, layout):
    from test_context_parallel_ranks import _one_process

    batches = [_one_process(10 + d, layout, "ulysses") for d in range(DP)]
    for got in ranks:
        expected = batches[got["dp_rank"]]["logprobs"]
        torch.testing.assert_close(got[layout]["logprobs"], expected, **TOLERANCE)
    for name in batches[0]["grads"]:  # the sum over CP, the mean over all four data-parallel ranks
        mean = sum(batch["grads"][name] for batch in batches) / DP
        for got in ranks:
            torch.testing.assert_close(got[layout]["grads"][name], mean, **TOLERANCE, msg=f"{layout} {name}")
