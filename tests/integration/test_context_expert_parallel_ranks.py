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
heads, experts), as tests/integration/test_context_parallel_ranks.py and
test_expert_parallel_ranks.py argue: 1e-9 holds on any CPU and thread count, while a CP rank
balancing its slice alone, or replaying the wrong tokens' experts, moves results by 1e-3 and more.
"""

from __future__ import annotations

import uuid
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rldock_e2e.moe_fixture import NUM_EXPERTS, cp_moe_model, ep_job_config, whole_gradients
from rldock_e2e.scored_batch import LAYOUTS, PROMPT_LENGTH, RESPONSE_LENGTH, scored_batch

pytestmark = pytest.mark.integration

WORLD, CP = 4, 2
EXPERT_PARALLEL_SIZES = (2, 4)  # an EP group is a CP group; an EP group spans both CP groups
COEF = 0.5  # the router's auxiliary-loss coefficient
TOL = dict(rtol=1e-9, atol=1e-12)
CASES = [(layout, replay) for layout in ("packed", "padded") for replay in (False, True)]


def _batch(seed: int) -> dict[str, torch.Tensor]:
    return scored_batch(seed, vocab_size=64)


def _random_routing() -> torch.Tensor:
    """A record (B, PL + SL, layers, k) of two distinct experts per token, none the router's choice
    by design: what replay makes every pass use."""
    g = torch.Generator().manual_seed(7)
    scores = torch.rand(4, PROMPT_LENGTH + RESPONSE_LENGTH, 2, NUM_EXPERTS, generator=g)
    return scores.argsort(dim=-1)[..., :2].to(torch.int16)


def _scored(model, batch, layout: str, *, replay: bool) -> dict:
    """The logprobs (4, 7), the loss (linear in the logprobs, plus COEF x the load-balancing loss) and
    its value, after the backward; as the update's policy step records, replays and adds the router term."""
    from rldock.runtime.engines.policy import response_logprobs
    from rldock.runtime.models.moe import RouterLoss
    from rldock.runtime.models.routing_replay import pass_listeners, replaying_routes

    router = RouterLoss(model, coef=COEF)
    replaying = replaying_routes(model, _random_routing()) if replay else nullcontext()
    with replaying as replayed, router.recording(model) as record:
        logprobs = response_logprobs(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            routes=pass_listeners(replayed, record),
            **LAYOUTS[layout],
        )
    loss, metrics = router.add((logprobs * batch["weights"]).sum(), {}, record, share=1.0)
    loss.backward()
    return dict(logprobs=logprobs.detach(), loss=float(loss.detach()), aux=metrics["moe/aux_loss"])


def _recorded(model, batch) -> torch.Tensor:
    """The routing a packed pass over the batch records (B, PL + SL, layers, k): the old logprobs' pass
    under algorithm.routing_replay reference."""
    from rldock.runtime.engines.policy import response_logprobs
    from rldock.runtime.models.routing_replay import recording_routes

    with torch.no_grad(), recording_routes(model, num_rows=4, row_width=PROMPT_LENGTH + RESPONSE_LENGTH) as record:
        args = (batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"])
        response_logprobs(model, *args, routes=record, **LAYOUTS["packed"])
    return record.routed_experts()


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.policy import packing_prompts
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    batch = _batch(10 + rank // CP)  # data-parallel rank rank // CP's rows
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
        results[ep] = {"recorded": _recorded(model, batch)}
        for layout, replay in CASES:
            model.zero_grad()
            scored = _scored(model, batch, layout, replay=replay)
            results[ep][layout, replay] = scored | {"grads": whole_gradients(backend)}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


def _one_process(batch_seed: int, layout: str, *, replay: bool) -> dict:
    model = cp_moe_model()
    scored = _scored(model, _batch(batch_seed), layout, replay=replay)
    return scored | {"grads": {name: p.grad for name, p in model.named_parameters()}}


def test_context_and_expert_parallel_equal_one_process(tmp_path):
    # a file rendezvous no earlier group used: a probed free port could be taken before rank 0 binds it
    rendezvous = f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex}"
    mp.spawn(_rank, args=(rendezvous, str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    recorded = [_recorded(cp_moe_model(), _batch(10 + d)) for d in range(WORLD // CP)]
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
