"""Expert parallelism on real gloo ranks (torch.multiprocessing, CPU): a Qwen3-MoE model's experts
split over EP 2 and EP 4 (and EP 2 inside FSDP over 4 ranks, two ranks per expert shard) give the
single-process model's logprobs, loss, gradients and gradient norm, and the weights gathered at EP 4
(what a checkpoint writes) load at EP 1 into the same logprobs.

Tolerance: the model runs in float64 (unit roundoff 1.1e-16). The EP ranks compute each token with the
same operations as one process, only grouped differently (a rank's batch, tokens sorted by expert,
gradient sums split across ranks), so the results differ by reassociation alone: relative errors of a
few hundred roundoffs through two layers, far below rtol 1e-9. A routing flip would need two router
probabilities within ~1e-15 of each other; the test also asserts every token's experts are the same."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist

from rldock_e2e.moe_fixture import ROWS_PER_RANK, SEQ, ep_job_config, token_logprobs, whole_batch, whole_gradients
from rldock_e2e.moe_fixture import moe_model as _model

pytestmark = pytest.mark.ranks

TOL = dict(rtol=1e-9, atol=1e-12)


def _rank(rank: int, world: int, ep: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.models.moe import record_routing
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    backend = FsdpBackend(
        ep_job_config(world, ep),
        model=_model(),
        make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),  # momentum: a state to save
        device=detect_device("cpu"),
        rank=rank,
    )
    mine = whole_batch(world)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    with record_routing(backend.model) as routing:
        logprobs = token_logprobs(backend.model, mine)
    loss = -logprobs.mean()
    loss.backward()
    grads = whole_gradients(backend)
    grad_norm = backend.clip_gradients(1e9)
    backend.optimizer.step()
    with torch.no_grad():
        stepped = token_logprobs(backend.model, mine)  # after the step: what the checkpoint must reproduce
    weights = {name: tensor.clone() for name, tensor in backend.full_state()}
    # The optimizer state round-trips through one file: gathered whole (experts from every EP rank),
    # then every rank keeps its own shard and experts again.
    before = {name: state["momentum_buffer"].clone() for name, state in backend.optimizer.state_dict()["state"].items()}
    optimizer_state = backend.full_optimizer_state()
    if rank == 0:
        torch.save(optimizer_state, Path(out_dir) / "optimizer.pt")
    dist.barrier()
    backend.load_optimizer_state(Path(out_dir) / "optimizer.pt")
    after = backend.optimizer.state_dict()["state"]
    reloaded = all(_local(after[name]["momentum_buffer"]).equal(_local(value)) for name, value in before.items())
    torch.save(
        {
            "logprobs": logprobs.detach(),
            "loss": float(loss.detach()),
            "grads": grads,
            "grad_norm": grad_norm,
            "weights": weights,
            "stepped": stepped,
            "optimizer_reloaded": reloaded,
            "experts": [indices for indices in routing.indices[0]],
        },
        Path(out_dir) / f"rank{rank}.pt",
    )
    dist.barrier()  # every rank's last collective has arrived before any tears the group down
    dist.destroy_process_group()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rendezvous(tmp_path: Path) -> str:
    # A file no earlier group used: a port probed free and bound later by rank 0 could be taken
    # by another process in between.
    return f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex}"


def _spawn_ranks(out_dir: Path, world: int, ep: int) -> Path:
    """`world` gloo ranks at expert parallel size `ep` stepping once (`_rank`); the folder of their files."""
    rank_processes.spawn(_rank, args=(world, ep, _rendezvous(out_dir), str(out_dir)), nprocs=world)
    return out_dir


@pytest.fixture(scope="module")
def ep4_ranks(tmp_path_factory) -> Path:
    """The EP 4 ranks' files, which the ep4 case below and the EP 1 load test both read (one spawn of
    four processes fewer)."""
    return _spawn_ranks(tmp_path_factory.mktemp("ep4-ranks"), 4, 4)


@pytest.mark.parametrize(("world", "ep"), [(2, 2), (4, 4), (4, 2)], ids=["ep2", "ep4", "ep2xfsdp2"])
def test_expert_parallel_equals_one_process(tmp_path, world, ep, request):
    from rldock.runtime.models.moe import record_routing

    out = request.getfixturevalue("ep4_ranks") if (world, ep) == (4, 4) else _spawn_ranks(tmp_path, world, ep)
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]

    model = _model()
    batch = whole_batch(world)
    with record_routing(model) as routing:
        logprobs = token_logprobs(model, batch)  # (B, L-1)
    loss = -logprobs.mean()
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    norm = float(torch.nn.utils.get_total_norm(list(grads.values())))

    for rank, got in enumerate(ranks):
        rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
        tokens = slice(rank * ROWS_PER_RANK * SEQ, (rank + 1) * ROWS_PER_RANK * SEQ)
        for layer, chosen in enumerate(got["experts"]):  # the same experts for every token
            assert torch.equal(chosen.sort(-1).values, routing.indices[0][layer][tokens].sort(-1).values)
        torch.testing.assert_close(got["logprobs"], logprobs[rows].detach(), **TOL)
        assert got["grads"].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got["grads"][name], grad, **TOL, msg=name)
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-9)
        # Momentum SGD's first buffer is the gradient: the gathered file holds one process's.
        assert got["optimizer_reloaded"]
        # The gathered weights are the whole model in its own names and shapes (the HF layout).
        assert {n: t.shape for n, t in got["weights"].items()} == {n: t.shape for n, t in model.state_dict().items()}
    saved = torch.load(out / "optimizer.pt")["state"]
    for name, grad in grads.items():
        torch.testing.assert_close(saved[name]["momentum_buffer"], grad, **TOL, msg=name)
    # The mean of the ranks' losses is the whole batch's (equal token counts per rank).
    assert sum(r["loss"] for r in ranks) / world == pytest.approx(float(loss), rel=1e-12)


def test_weights_gathered_at_ep4_load_at_ep1(tmp_path, ep4_ranks):
    """A checkpoint written at EP 4 after a step (its weights gathered whole) saved in the Hugging Face
    layout and loaded by the ordinary loader at EP 1 scores tokens as the EP 4 ranks did."""
    from rldock.runtime.models import load_causal_lm

    world = 4
    ranks = [torch.load(ep4_ranks / f"rank{r}.pt") for r in range(world)]
    model = _model()
    model.load_state_dict(ranks[0]["weights"])
    model.save_pretrained(tmp_path / "checkpoint")
    loaded = load_causal_lm(tmp_path / "checkpoint", dtype=torch.float64)
    loaded.config._experts_implementation = "eager"  # the default grouped_mm kernel refuses float64
    with torch.no_grad():
        logprobs = token_logprobs(loaded, whole_batch(world))
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["stepped"], logprobs[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK], **TOL)


def _swap_rank(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    cfg = ep_job_config(world, 2)
    cfg = cfg.model_copy(update={"training": cfg.training.model_copy(update={"resharding": "allgather_swap"})})
    backend = FsdpBackend(
        cfg,
        model=_model(),
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        device=detect_device("cpu"),
        rank=rank,
    )
    mine = whole_batch(world)[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK]
    (-token_logprobs(backend.model, mine).mean()).backward()
    backend.step(1e9)
    with torch.no_grad():
        before = token_logprobs(backend.model, mine)
    pushed: dict[str, torch.Tensor] = {}
    backend.to_generation(lambda weights: pushed.update({name: tensor.clone() for name, tensor in weights}))
    ledger = backend.drain_metrics()["ledger"]
    backend.to_training()
    with torch.no_grad():
        after = token_logprobs(backend.model, mine)
    torch.save({"before": before, "after": after, "pushed": pushed, "ledger": ledger}, Path(out_dir) / f"swap{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_allgather_swap_moves_expert_shards_off_and_back(tmp_path):
    """Under resharding: allgather_swap at EP 2 x FSDP 2 the engine gets every expert whole, no training
    state stays on the device during generation, and the swapped-in model scores as before."""
    world = 4
    rank_processes.spawn(_swap_rank, args=(world, _rendezvous(tmp_path), str(tmp_path)), nprocs=world)
    shapes = {name: tensor.shape for name, tensor in _model().state_dict().items()}
    for rank in range(world):
        got = torch.load(tmp_path / f"swap{rank}.pt")
        assert {name: tensor.shape for name, tensor in got["pushed"].items()} == shapes
        prefix = f"memory/rank{rank}/generation"
        state = sum(got["ledger"][f"{prefix}/{c}"] for c in ("train_params", "grads", "optimizer_state"))
        assert state == 0 and got["ledger"][f"{prefix}/host_swap"] > 0
        assert torch.equal(got["before"], got["after"])
