"""Context parallelism composed with expert parallelism on real gloo ranks (torch.multiprocessing,
CPU): a Qwen3-MoE model on 4 ranks, 2 data-parallel ranks of CP 2, its experts split over EP 2 (an
EP group is a CP group) and EP 4 (an EP group spans both CP groups), gives one process's logprobs,
loss (the router's load-balancing term included) and mean gradient over the two data-parallel
batches, on a packed and a padded batch, with routing replay off and on; and the routing the CP
ranks record, merged, is one process's.

Replay routes by a random record (not the router's own choice), so a rank replaying another rank's
tokens' experts changes the logprobs. The load-balancing coefficient is large (0.5) so its term
weighs in the loss and gradients as much as the logprobs do.

Tolerance: float64 throughout, results differing by reassociation only (sums split over ranks,
heads, experts), as tests/ranks/test_context_parallel_ranks.py and
test_expert_parallel_ranks.py argue: 1e-9 holds on any CPU and thread count, while a CP rank
balancing its slice alone, or replaying the wrong tokens' experts, moves results by 1e-3 and more.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist

from rldock_e2e.moe_fixture import (
    cp_batch,
    cp_moe_model,
    ep_job_config,
    recorded_routing,
    scored_with_router_loss,
    whole_gradients,
)

pytestmark = pytest.mark.ranks

WORLD, CP = 4, 2
EXPERT_PARALLEL_SIZES = (2, 4)  # an EP group is a CP group; an EP group spans both CP groups
TOL = dict(rtol=1e-9, atol=1e-12)
CASES = [(layout, replay) for layout in ("packed", "padded") for replay in (False, True)]  # replay: a random record


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.policy import packing_prompts
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    batch = cp_batch(10 + rank // CP)  # data-parallel rank rank // CP's rows
    results: dict = {}
    for ep in EXPERT_PARALLEL_SIZES:
        backend = FsdpBackend(
            ep_job_config(WORLD, ep, context_parallel_size=CP),
            model=cp_moe_model(),
            make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            device=detect_device("cpu"),
            rank=rank,
        )
        model = backend.model
        args = (batch["prompt_ids"], batch["prompt_mask"], batch["response_mask"])
        assert packing_prompts(model, *args, trim=True, micro_batch_size=4) is not None  # "packed" packs
        results[ep] = {"recorded": recorded_routing(model, batch)}
        for layout, replay in CASES:
            model.zero_grad()
            scored = scored_with_router_loss(model, batch, layout, replay=replay)
            results[ep][layout, replay] = scored | {"grads": whole_gradients(backend)}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


def _one_process(batch_seed: int, layout: str, *, replay: bool) -> dict:
    model = cp_moe_model()
    scored = scored_with_router_loss(model, cp_batch(batch_seed), layout, replay=replay)
    return scored | {"grads": {name: p.grad for name, p in model.named_parameters()}}


def test_context_and_expert_parallel_equal_one_process(tmp_path):
    # a file rendezvous no earlier group used: a probed free port could be taken before rank 0 binds it
    rendezvous = f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex}"
    rank_processes.spawn(_rank, args=(rendezvous, str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    recorded = [recorded_routing(cp_moe_model(), cp_batch(10 + d)) for d in range(WORLD // CP)]
    for layout, replay in CASES:
        shards = [_one_process(10 + d, layout, replay=replay) for d in range(WORLD // CP)]
        for ep in EXPERT_PARALLEL_SIZES:
            for rank, got in enumerate(r[ep] for r in ranks):  # a CP rank holds its dp rank's scores and loss
                want, case = shards[rank // CP], f"ep{ep} {layout} replay {replay}"
                assert torch.equal(got["recorded"], recorded[rank // CP])  # the CP group's merged record
                torch.testing.assert_close(got[layout, replay]["logprobs"], want["logprobs"], **TOL, msg=case)
                assert got[layout, replay]["aux"] == pytest.approx(want["aux"], rel=1e-9), case
                assert got[layout, replay]["loss"] == pytest.approx(want["loss"], rel=1e-9), case
                for name, grad in shards[0]["grads"].items():  # the sum over CP, the mean over the dp ranks
                    mean = (grad + shards[1]["grads"][name]) / 2
                    torch.testing.assert_close(got[layout, replay]["grads"][name], mean, **TOL, msg=f"{case} {name}")
