"""The MoE router's load-balancing loss under pipeline parallelism, on 4 real gloo ranks (torch.multiprocessing,
CPU): the tiny Qwen3-MoE (2 MoE layers, one a stage) through the actor's FsdpBackend at PP 2 x EP 2 (each
stage's 8 experts split over its data-parallel pair, each pair its own batch) and at PP 2 x CP 2 x EP 2 (each
stage's CP pair splits every sequence's positions and is its EP group). The update's step over 2 micro-batches
of 2 rows on the 1F1B schedule, on packed and on padded passes, with the router term added as the policy step
adds it (models/router_loss.py: weighted by the coefficient and the micro-batch's share), gives one process's
loss, load-balancing loss, gradient norm and every gradient over the same micro-batches.

Hugging Face's loss sums every layer's routing before its product, so a stage's layers alone have no loss to
add: a stage that balanced its own layer (the refusal this replaced), or an earlier stage whose routers got no
gradient, is off by far more than the tolerance. The coefficient is large (0.5, moe_fixture.ROUTER_COEF) so the
term weighs in the gradients as the logprobs do. Float64 throughout: the ranks add the same products in another
order, so 1e-9 holds on any CPU and thread count.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist

from rldock_e2e.moe_fixture import ROUTER_COEF, cp_batch, cp_moe_model, ep_job_config, whole_gradients
from rldock_e2e.scored_batch import LAYOUTS

pytestmark = pytest.mark.ranks

WORLD = 4
TOL = dict(rtol=1e-9, atol=1e-12)
PASSES = ("packed", "padded")  # a packed pass's real tokens are its cells; a padded pass's exclude the pads
# layout -> (context_parallel_size, data-parallel ranks)
LAYOUTS_PP = {"pp2_ep2": (1, 2), "pp2_cp2_ep2": (2, 1)}


def _micro_batches(dp_rank: int):
    """A data-parallel rank's mini-batch (`cp_batch`, 4 rows) as 2 micro-batches of one prompt's 2 rows."""
    from tensordict import TensorDict

    batch = TensorDict(cp_batch(10 + dp_rank), batch_size=[4])
    return [batch[:2], batch[2:]]


def _micro_loss(model, module, passes: str, *, dp: int):
    """The policy step's micro-batch loss (training/policy_steps.py) with a loss linear in the logprobs: the
    routing recorded around the pass, the router term added with the micro-batch's share of the mini-batch;
    times `dp` where FSDP averages the gradients of `dp` data-parallel ranks (so the step's is the sum's)."""
    from rldock.runtime.engines.policy import response_logprobs_and_entropy
    from rldock.runtime.models.router_loss import RouterLoss

    router = RouterLoss(model, coef=ROUTER_COEF)

    def micro_loss(micro):
        keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
        with router.recording(module) as record:
            scores = response_logprobs_and_entropy(module, *(micro[k] for k in keys), **LAYOUTS[passes], routes=record)
        linear = (scores.logprobs * micro["weights"]).sum()
        loss, metrics = router.add(linear, {"loss": float(linear.detach())}, record, share=0.5)
        return loss * dp, metrics | {"loss": metrics["loss"] + float((loss - linear).detach())}

    return micro_loss


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.accumulation import accumulate
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=WORLD)
    results: dict = {}
    for name, (cp, _) in LAYOUTS_PP.items():
        backend = FsdpBackend(
            ep_job_config(WORLD, 2, context_parallel_size=cp, pipeline_parallel_size=2),
            model=cp_moe_model(),
            make_optimizer=lambda params: torch.optim.SGD(params, lr=0.0),  # the step leaves the weights
            device=detect_device("cpu"),
            rank=rank,
        )
        stage, context = backend.pipeline, backend.context
        assert stage is not None and stage.links.carry_width == 2 * 8 + 8 + 1  # the totals of 2 routers, 8 experts
        for passes in PASSES:
            micro_loss = _micro_loss(backend.model, backend.training_module(), passes, dp=context.dp)
            stats = accumulate(backend, _micro_batches(context.dp_rank), micro_loss, max_grad_norm=1e9)
            grads = {stage.names.whole(n): g.clone() for n, g in whole_gradients(backend).items()}
            results[name, passes] = dict(stats, grads=grads, dp_rank=context.dp_rank)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


def _one_process(passes: str) -> list[dict]:
    """Each data-parallel rank's micro-batches one after another through the whole model: its metrics summed
    over them, and its gradients."""
    model, by_dp_rank = cp_moe_model(), []
    for dp_rank in range(2):
        micro_loss, total = _micro_loss(model, model, passes, dp=1), {"loss": 0.0, "moe/aux_loss": 0.0}
        model.zero_grad()
        for micro in _micro_batches(dp_rank):
            loss, metrics = micro_loss(micro)
            loss.backward()
            total = {key: total[key] + metrics[key] for key in total}
        by_dp_rank.append(total | {"grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
    return by_dp_rank


def _step_gradients(by_dp_rank: list[dict], dp: int) -> tuple[dict, float]:
    """The step's gradients over `dp` data-parallel ranks (the sum of their losses') and their norm."""
    grads = {n: sum(rank["grads"][n] for rank in by_dp_rank[:dp]) for n in by_dp_rank[0]["grads"]}
    return grads, float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))


def test_the_router_loss_through_pipeline_stages_is_one_process_s(tmp_path):
    # a file rendezvous no earlier group used: a probed free port could be taken before rank 0 binds it
    rendezvous = f"file://{tmp_path}/rendezvous-{uuid.uuid4().hex}"
    rank_processes.spawn(_rank, args=(rendezvous, str(tmp_path)), nprocs=WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for passes in PASSES:
        by_dp_rank = _one_process(passes)
        for name, (_, dp) in LAYOUTS_PP.items():
            (grads, norm), case = _step_gradients(by_dp_rank, dp), f"{name} {passes}"
            for got in (r[name, passes] for r in ranks):
                want = by_dp_rank[got["dp_rank"]]  # the last stage's metrics, on every stage
                assert want["moe/aux_loss"] > 1.0, case  # k = 2 is perfect balance; each micro-batch's, times 0.5
                assert got["moe/aux_loss"] == pytest.approx(want["moe/aux_loss"], rel=1e-9), case
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-9), case
                assert got["grad_norm"] == pytest.approx(norm, rel=1e-9), case
                for grad_name, grad in got["grads"].items():
                    # the last stage's head is the tied embedding's copy, its gradient the sum of both stages'
                    reference = "model.embed_tokens.weight" if grad_name == "lm_head.weight" else grad_name
                    torch.testing.assert_close(grad, grads[reference], **TOL, msg=f"{case} {grad_name}")
            # each stage's routers: both layers' gates have gradients, on one stage each
            gates = {n for r in ranks for n in r[name, passes]["grads"] if n.endswith("mlp.gate.weight")}
            assert gates == {"model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"}, case
