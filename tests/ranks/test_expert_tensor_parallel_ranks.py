"""EP 2 x TP 2 on 4 real gloo ranks (torch.multiprocessing, CPU): a Qwen3-MoE model's attention split over
each TP pair, its experts over EP 2 inside each TP rank's sequence ranks, FSDP over those (the training
mesh: dp 2, tp 2, ep 2) gives the single-process model's logprobs, loss, gradients and gradient norm, and
its gathered weights (what the engine and a checkpoint get) are the whole model in the Hugging Face layout.

Ranks are (d, t) = (rank // 2, rank % 2): the TP pair of data-parallel rank d reads its rows and runs the
same tokens through the experts, each TP rank in its own EP group (ranks {t, 2 + t}), so an expert's
gradient is summed over the data-parallel ranks' tokens once per TP rank, never over TP. The attention's
per-head q_norm and k_norm are TP-partial, as under FSDP x TP.

Tolerance: float64 (unit roundoff 1.1e-16), the same operations as one process grouped differently (TP's
partial sums, the EP dispatch, FSDP's reduction), so the results differ by reassociation alone; rtol 1e-9
holds on any CPU and thread count, while an expert gradient summed over TP (doubled) or a missed per-head
sum is off by order 1. Every token's experts are asserted the same as one process's (a routing flip would
need router probabilities within ~1e-15)."""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist

from rldock_e2e.moe_fixture import (
    NUM_EXPERTS,
    ROWS_PER_RANK,
    SEQ,
    ep_job_config,
    token_logprobs,
    whole_batch,
    whole_gradients,
)
from rldock_e2e.moe_fixture import moe_model as _moe_model

pytestmark = pytest.mark.ranks

WORLD, DP, TP, EP = 4, 2, 2, 2
TOL = dict(rtol=1e-9, atol=1e-12)


def _model():
    return _moe_model(num_attention_heads=4, num_key_value_heads=2)  # TP 2 gives each rank 2 and 1


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.models.moe import record_routing
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    backend = FsdpBackend(
        ep_job_config(WORLD, EP, tensor_parallel_size=TP),
        model=_model(),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        device=detect_device("cpu"),
        rank=rank,
    )
    d = backend.context.dp_rank
    mine = whole_batch(DP)[d * ROWS_PER_RANK : (d + 1) * ROWS_PER_RANK]
    with record_routing(backend.model) as routing:
        logprobs = token_logprobs(backend.model, mine)
    loss = -logprobs.mean()
    loss.backward()
    grad_norm = backend.clip_gradients(1e9)  # after the per-head sums over TP
    grads = whole_gradients(backend)
    experts = backend.experts
    torch.save(
        {
            "dp_rank": d,
            "ep_group": dist.get_process_group_ranks(experts.sharding.group) if experts else None,
            "local_experts": next(
                p.shape[0] for n, p in backend.model.named_parameters() if n.endswith("experts.gate_up_proj")
            ),
            "logprobs": logprobs.detach(),
            "loss": float(loss.detach()),
            "grads": grads,
            "grad_norm": grad_norm,
            "weights": dict(backend.full_state()),
            "experts": list(routing.indices[0]),
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.barrier()  # every rank's last collective has arrived before any tears the group down
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("ep-tp-ranks")
    rank_processes.spawn(_rank, args=(f"file://{out_dir}/rendezvous", str(out_dir)), nprocs=WORLD)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def test_each_tp_rank_runs_its_own_ep_group_over_its_pair_s_rows(ranks):
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1]
    assert [r["ep_group"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["local_experts"] for r in ranks] == [NUM_EXPERTS // EP] * WORLD  # one EP rank per shard: no FSDP cut


def test_ep_by_tp_gives_one_process_s_logprobs_gradients_and_weights(ranks):
    from rldock.runtime.models.moe import record_routing

    model = _model()
    batch = whole_batch(DP)
    with record_routing(model) as routing:
        logprobs = token_logprobs(model, batch)
    loss = -logprobs.mean()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    norm = float(torch.nn.utils.get_total_norm(list(grads.values())))
    for got in ranks:
        d = got["dp_rank"]
        rows, tokens = slice(d * ROWS_PER_RANK, (d + 1) * ROWS_PER_RANK), slice(d * ROWS_PER_RANK * SEQ, None)
        for layer, chosen in enumerate(got["experts"]):  # the same experts for every token
            expected = routing.indices[0][layer][tokens][: len(chosen)]
            assert torch.equal(chosen.sort(-1).values, expected.sort(-1).values)
        torch.testing.assert_close(got["logprobs"], logprobs[rows].detach(), **TOL)
        assert got["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, **TOL, msg=name)
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-9)
        weights = model.state_dict()
        assert got["weights"].keys() == weights.keys()
        for name, tensor in weights.items():
            torch.testing.assert_close(got["weights"][name], tensor, **TOL, msg=name)
    assert sum(r["loss"] for r in ranks) / WORLD == pytest.approx(float(loss), rel=1e-12)
