"""PPO's critic under pipeline parallelism on 4 real gloo ranks (torch.multiprocessing, CPU): the value model
(a 4-layer Qwen2 body and a value head) built into the critic's backend as workers/critic.py builds it
(`build_backend(..., data_parallel_only=True, defer_gradient_sync=True)`: the job's layout without TP) is cut
into stages, and in each layout below, on the same batch:
- each stage holds only its own layers (the first the embedding, the last the final norm and the value head);
- the no-gradient pass (critic_inference's) gives the last stage one process's values, the others zeros;
- the critic's step (training/value_step.py: the clipped value loss over micro-batches of one row on the 1F1B
  schedule) gives one process's value loss and gradient norm on every stage, every gradient (each stage its
  own layers', under the whole model's names), and after AdamW's step the weights every rank gathers;
- (PP 2 x FSDP 2) the checkpoint's two files written as the critic writes them are one process's (the whole
  value model, its AdamW state by the whole model's names), and they load whole under FSDP 4 at PP 1 and into
  PP 4's stages, each gathering back the same files.

Layouts: PP 4 (one layer a stage: two middle stages), PP 2 x FSDP 2 (each stage sharded over its data-parallel
pair, each pair its own half of the rows) and PP 2 x CP 2 (each stage's CP pair splits every sequence's
positions). Float64 throughout, as tests/ranks/test_pipeline_parallel_ranks.py explains: 1e-9 holds for
a layout that computes the same sums in another order, while a wrong stage is off by far more.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist
from test_fsdp_ranks import _adamw, _cfg
from test_pipeline_parallel_ranks import TINY, TOLERANCE, _assert_one_process_gradients

from rldock_e2e.scored_batch import scored_batch

pytestmark = pytest.mark.ranks

WORLD = 4
LAYOUTS_PP = {
    "pp4": dict(data_parallel_size=1, pipeline_parallel_size=4),
    "pp2_fsdp2": dict(data_parallel_size=2, pipeline_parallel_size=2),
    "pp2_cp2": dict(data_parallel_size=1, pipeline_parallel_size=2, context_parallel_size=2),
}
KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")


def _critic_cfg(**training):
    """A PPO job's config: micro-batches of one row (PP 4's schedule runs 4), the gradient norm unclipped."""
    cfg = _cfg(devices=WORLD, micro_batch_size=1, **training)
    algorithm = cfg.algorithm.model_copy(update={"name": "ppo", "max_grad_norm": 1e9})
    return cfg.model_copy(update={"algorithm": algorithm})


def _value_model():
    """The value model of a 4-layer untied Qwen2, its head random (not the zero start), alike on every rank."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rldock.runtime.models.value import ValueModel

    torch.manual_seed(0)
    body = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=False, attn_implementation="sdpa")).model
    value = ValueModel(body, TINY["hidden_size"]).double().eval()
    torch.nn.init.normal_(value.head.weight, generator=torch.Generator().manual_seed(2))
    return value


def _batch():
    """The scored batch (4 rows) with the update's columns: old values and returns (float32, as the dock's)."""
    from tensordict import TensorDict

    batch = scored_batch(1, vocab_size=TINY["vocab_size"])
    g = torch.Generator().manual_seed(5)
    shape = batch["response_ids"].shape
    old = torch.randn(shape, generator=g, dtype=torch.float64) * 0.3
    returns = torch.randn(shape, generator=g, dtype=torch.float64)
    columns = {k: batch[k] for k in KEYS}
    return TensorDict({**columns, "values": old, "returns": returns}, batch_size=[4])


def _values(model, batch) -> torch.Tensor:
    from rldock.runtime.engines.values import response_values

    with torch.no_grad():
        return response_values(model, *(batch[k] for k in KEYS), micro_batch_size=2, trim=True)


def _backend(rank: int, **training):
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.strategies import build_backend

    return build_backend(
        _critic_cfg(**training),
        model=_value_model(),
        make_optimizer=_adamw,
        device=detect_device("cpu"),
        rank=rank,
        world_size=WORLD,
        data_parallel_only=True,
        defer_gradient_sync=True,
    )


def _reloaded(out_dir: Path, rank: int, **training) -> dict:
    """A fresh critic backend of `training`'s layout loading the checkpoint's files as CriticWorker.load does:
    the weights and optimizer state it gathers back."""
    from rldock.runtime.training.backend import load_full_weights

    backend = _backend(rank, **training)
    load_full_weights(backend, torch.load(out_dir / "critic.pt"))
    backend.load_optimizer(out_dir / "critic_optimizer.pt", map_location="cpu")
    weights = {n: t.clone() for n, t in backend.full_state()}
    return dict(weights=weights, optimizer=backend.full_optimizer_state())


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.training.value_step import value_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    results: dict = {}
    for name, training in LAYOUTS_PP.items():
        backend = _backend(rank, **training)
        stage = backend.pipeline
        assert stage is not None
        found: dict = dict(stage=stage.links.index, last=stage.last, dp_rank=backend.context.dp_rank)
        found["held"] = {stage.names.whole(n) for n, _ in backend.model.named_parameters()}
        batch = _batch()
        found["values"] = _values(backend.model, batch)
        dp, dp_rank = backend.context.dp, backend.context.dp_rank
        rows = batch[dp_rank * 4 // dp : (dp_rank + 1) * 4 // dp]  # this data-parallel rank's share
        stats = value_step(backend, rows, cfg=_critic_cfg(**training), world_size=WORLD)
        found["value_loss"], found["norm"] = stats["value_loss"], stats["value_grad_norm"]
        grads = ((n, p.grad.full_tensor()) for n, p in backend.model.named_parameters())
        found["grads"] = {stage.names.whole(n): g.clone() for n, g in grads}
        found["weights"] = {n: t.clone() for n, t in backend.full_state()}
        results[name] = found
        if name == "pp2_fsdp2":  # the critic's save (workers/critic.py), then its load in two other layouts
            weights = backend.full_weights()
            backend.save_optimizer(Path(out_dir) / "critic_optimizer.pt")
            if rank == 0:
                torch.save(weights, Path(out_dir) / "critic.pt")
            dist.barrier()
            results["fsdp4"] = _reloaded(Path(out_dir), rank, data_parallel_size=4)
            results["pp4_reloaded"] = _reloaded(Path(out_dir), rank, **LAYOUTS_PP["pp4"])
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("pp-critic-ranks")
    rank_processes.spawn(_rank, args=(str(out_dir / "rendezvous"), str(out_dir)), nprocs=WORLD)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)] + [out_dir]


@pytest.fixture(scope="module")
def one_process() -> dict:
    """The critic's step in one process (a lone critic rank: the DDP backend's world of one)."""
    from rldock.runtime.training.ddp import DdpBackend
    from rldock.runtime.training.value_step import value_step

    cfg, model = _critic_cfg(**LAYOUTS_PP["pp4"]), _value_model()
    backend = DdpBackend(cfg, model=model, optimizer=_adamw(model.parameters()), rank=0, world_size=1)
    batch = _batch()
    values = _values(model, batch)
    stats = value_step(backend, batch, cfg=cfg, world_size=1)
    names = [n for n, _ in model.named_parameters()]
    adam = {names[i]: state for i, state in backend.optimizer.state_dict()["state"].items()}
    return dict(
        values=values,
        value_loss=stats["value_loss"],
        norm=stats["value_grad_norm"],
        grads={n: p.grad.clone() for n, p in model.named_parameters()},
        weights={n: t.clone() for n, t in model.state_dict().items()},
        adam=adam,
    )


def test_each_stage_holds_only_its_layers(ranks):
    """The value model is cut as the policy is: stage s of p holds its run of the 4 layers, the first the
    embedding, the last the final norm and the value head; the data-parallel and CP peers of a stage alike."""
    layers = {name: set() for name in LAYOUTS_PP}
    for got in ranks[:WORLD]:
        for name in LAYOUTS_PP:
            held, stage = got[name]["held"], got[name]["stage"]
            assert ("body.embed_tokens.weight" in held) == (stage == 0)
            assert ("head.weight" in held and "body.norm.weight" in held) == got[name]["last"]
            mine = {n.split(".")[2] for n in held if n.startswith("body.layers.")}
            layers[name].add((stage, tuple(sorted(mine))))
    assert layers["pp4"] == {(0, ("0",)), (1, ("1",)), (2, ("2",)), (3, ("3",))}
    assert layers["pp2_fsdp2"] == layers["pp2_cp2"] == {(0, ("0", "1")), (1, ("2", "3"))}
    assert [r["pp2_fsdp2"]["stage"] for r in ranks[:WORLD]] == [0, 0, 1, 1]


@pytest.mark.parametrize("name", LAYOUTS_PP)
def test_the_critic_s_stages_give_one_process_s_values_loss_gradients_and_step(ranks, one_process, name):
    expected = one_process
    results = [r[name] for r in ranks[:WORLD]]
    for got in results:
        if got["last"]:  # the stage with the head writes the values (its first rank, to the dock)
            torch.testing.assert_close(got["values"], expected["values"], **TOLERANCE)
        else:
            assert not got["values"].any()
        assert got["norm"] == pytest.approx(expected["norm"], rel=1e-9)
        assert got["weights"].keys() == expected["weights"].keys()
        for weight_name, weight in expected["weights"].items():
            torch.testing.assert_close(
                got["weights"][weight_name], weight, **TOLERANCE, msg=lambda m, at=weight_name: f"{name} {at}: {m}"
            )
    _assert_one_process_gradients([got["grads"] for got in results], expected["grads"], name)
    # a data-parallel rank's loss is the last stage's on all its stages; at DP 1 the whole batch's
    by_dp_rank = {got["dp_rank"]: got["value_loss"] for got in results}
    assert all(got["value_loss"] == by_dp_rank[got["dp_rank"]] for got in results)
    if len(by_dp_rank) == 1:
        assert by_dp_rank[0] == pytest.approx(expected["value_loss"], rel=1e-9)


def test_the_checkpoint_written_by_stages_is_one_process_s_and_loads_at_pp1_and_pp4(ranks, one_process):
    out_dir = ranks[WORLD]
    weights = torch.load(out_dir / "critic.pt")
    assert weights.keys() == one_process["weights"].keys()  # the whole value model, by its own names
    for name, weight in one_process["weights"].items():
        torch.testing.assert_close(weights[name], weight, **TOLERANCE)
    saved = torch.load(out_dir / "critic_optimizer.pt")
    assert saved["state"].keys() == one_process["adam"].keys()
    for name, state in one_process["adam"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(saved["state"][name][key], state[key], **TOLERANCE, msg=f"{name} {key}")
    for got in ranks[:WORLD]:
        for layout in ("fsdp4", "pp4_reloaded"):  # each gathers back the files it read
            for name, weight in weights.items():
                torch.testing.assert_close(got[layout]["weights"][name], weight, rtol=0, atol=0)
        # the optimizer's file is written by global rank 0, the one rank that gathers it under PP
    for layout in ("fsdp4", "pp4_reloaded"):
        reloaded = ranks[0][layout]["optimizer"]
        assert reloaded["state"].keys() == saved["state"].keys()
        for name, state in saved["state"].items():
            torch.testing.assert_close(reloaded["state"][name]["exp_avg_sq"], state["exp_avg_sq"], rtol=0, atol=0)
