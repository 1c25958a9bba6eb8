"""Pipeline parallelism on 4 real gloo ranks (torch.multiprocessing, CPU): the actor's FsdpBackend cuts a
4-layer model into stages (training/pipeline.py) and, in each layout below, on the same batch:
- the no-gradient pass (old logprobs: the stages stream their passes) gives the last stage one process's
  logprobs, packed, on padded rows and on trimmed rows;
- the update's step over 4 micro-batches on the 1F1B schedule gives one process's loss, gradient norm and
  gradients (each stage its own layers', under the whole model's names), and after AdamW's step the weights
  every rank gathers (`full_state`: every stage's, in the Hugging Face layout) are one process's after its.

Layouts: PP 4 (one layer a stage: two middle stages), PP 2 x FSDP 2 (each stage sharded over its
data-parallel pair, each pair its own half of the rows), PP 2 x TP 2 (each stage's linears split over a TP
pair), PP 2 x CP 2 under Ulysses and under ring attention (each stage's CP pair splits every sequence's
positions, and a stage's CP rank hands its slice's activations to the next stage's) and PP 2 x EP 2 (the
tiny Qwen3-MoE, one MoE layer a stage, its 8 experts split over the stage's data-parallel pair; the router's
load-balancing loss is test_pipeline_router_loss_ranks.py's). The PP 4, PP 2 x TP 2, PP 2 x CP 2 (Ulysses) and MoE
models tie the embedding to the head (SmolLM2's layout: the last stage's copy and the first stage's
embedding sum their gradients) and PP 2 x FSDP 2's and the ring layout's do not. PP 2 x EP 2 again with
routing replay: the stages' merged routing record of a no-gradient pass is one process's, and the update
routed by a shifted copy of it (each stage replaying its own layers' columns of the whole model's grid) gives
one process's gradients. PP 4 again running DPO's preference step (a loss nonlinear in each pair's logprobs,
so only the last stage's counts): one process's loss and gradients.

Everything runs in float64, so the comparison measures the layout, not float32 rounding: the ranks add the
same products in another order (FSDP's halves, TP's partial sums, the micro-batches' sum), a few ulps of
float64 times the depth of the sums; 1e-9 holds on any CPU and thread count, while a stage that ran the wrong
layers, a missed activation gradient or a tied gradient left unsummed is off by 1e-3 and up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist
from test_fsdp_ranks import _adamw, _cfg

from rldock_e2e.scored_batch import LAYOUTS, scored_batch

pytestmark = pytest.mark.ranks

WORLD = 4
TOLERANCE = dict(rtol=1e-9, atol=1e-11)
TINY = dict(
    vocab_size=48,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# layout -> (training fields, model: "tied", "untied" or "moe")
LAYOUTS_PP = {
    "pp4": (dict(data_parallel_size=1, pipeline_parallel_size=4), "tied"),
    "pp2_fsdp2": (dict(data_parallel_size=2, pipeline_parallel_size=2), "untied"),
    "pp2_tp2": (dict(data_parallel_size=1, pipeline_parallel_size=2, tensor_parallel_size=2), "tied"),
    "pp2_cp2": (dict(data_parallel_size=1, pipeline_parallel_size=2, context_parallel_size=2), "tied"),
    "pp2_cp2_ring": (
        dict(data_parallel_size=1, pipeline_parallel_size=2, context_parallel_size=2, context_parallel_mode="ring"),
        "untied",
    ),
    "pp2_ep2": (
        dict(data_parallel_size=2, pipeline_parallel_size=2, expert_parallel_size=2),
        "moe",
    ),
}


def _model(kind: str):
    """A 4-layer Qwen2 (`tied` or `untied` embeddings), or the tiny Qwen3-MoE (2 layers of 8 experts)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rldock_e2e.moe_fixture import moe_model

    if kind == "moe":
        return moe_model()
    config = Qwen2Config(**TINY, tie_word_embeddings=kind == "tied", attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).double().eval()


def _batch() -> dict[str, torch.Tensor]:
    return scored_batch(1, vocab_size=TINY["vocab_size"])


def _logprobs(model, batch, layout: str) -> torch.Tensor:
    from rldock.runtime.engines.policy import response_logprobs

    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    return response_logprobs(model, *(batch[k] for k in keys), **LAYOUTS[layout])


def _micro_loss(model, dp: int = 1):
    """A loss linear in a micro-batch's logprobs (one pass of its rows, trimmed), and its value as a metric;
    times `dp` where FSDP averages the gradients of `dp` data-parallel ranks (so the step's is the sum's)."""
    from rldock.runtime.engines.policy import response_logprobs_and_entropy

    def micro_loss(micro):
        keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
        scores = response_logprobs_and_entropy(model, *(micro[k] for k in keys), micro_batch_size=len(micro), trim=True)
        loss = (scores.logprobs * micro["weights"]).sum()
        return loss * dp, {"loss": float(loss.detach())}

    return micro_loss


def _recording(backend, order: list[str], dp: int):
    """`_micro_loss` of the backend's model, appending F to `order` at each forward and B at each backward."""
    forward, accumulating = _micro_loss(backend.model, dp), backend.accumulating

    def backward_context(*, last: bool):
        order.append("B")
        return accumulating(last=last)

    def micro_loss(micro):
        order.append("F")
        return forward(micro)

    backend.accumulating = backward_context
    return micro_loss


REPLAY_PASS = "packed"  # the record's pass (the actor's old-logprob pass packs shared prompts)


def _shifted(record: torch.Tensor) -> torch.Tensor:
    """Every recorded expert moved on by one (a token's two stay distinct): routing no router chose, so a
    stage that replayed another layer's column, or no record, would route otherwise."""
    from rldock_e2e.moe_fixture import NUM_EXPERTS

    return torch.where(record >= 0, (record + 1) % NUM_EXPERTS, record)


def _replayed_micro_loss(model, dp: int):
    """`_micro_loss` with the pass routed by the micro-batch's `routed_experts` column (as the update's)."""
    from rldock.runtime.engines.policy import response_logprobs_and_entropy
    from rldock.runtime.models.routing_replay import replaying_batch

    def micro_loss(micro):
        keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
        with replaying_batch(model, micro) as replay:
            scores = response_logprobs_and_entropy(
                model, *(micro[k] for k in keys), micro_batch_size=len(micro), trim=True, routes=replay
            )
        loss = (scores.logprobs * micro["weights"]).sum()
        return loss * dp, {"loss": float(loss.detach())}

    return micro_loss


def _record(model) -> torch.Tensor:
    """The routing record (B, PL + SL, layers, k) of a no-gradient pass over the batch (merged over the stages)."""
    from rldock.runtime.engines.policy import response_logprobs
    from rldock.runtime.models.routing_replay import recording_routes

    batch = _batch()
    keys = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    width = batch["prompt_ids"].shape[1] + batch["response_ids"].shape[1]
    with torch.no_grad(), recording_routes(model, num_rows=len(batch["prompt_ids"]), row_width=width) as record:
        response_logprobs(model, *(batch[k] for k in keys), **LAYOUTS[REPLAY_PASS], routes=record)
    return record.routed_experts()


def _record_and_replay(rank: int) -> dict:
    """PP 2 x EP 2 with routing replay (module docstring): the merged record, and the gradients of the
    update over this data-parallel rank's micro-batches routed by its shifted copy."""
    from tensordict import TensorDict

    from rldock.runtime.device import detect_device
    from rldock.runtime.flow.columns import ROUTED_EXPERTS
    from rldock.runtime.training.accumulation import accumulate
    from rldock.runtime.training.fsdp import FsdpBackend
    from rldock_e2e.moe_fixture import whole_gradients

    training, kind = LAYOUTS_PP["pp2_ep2"]
    backend = FsdpBackend(
        _cfg(devices=WORLD, **training),
        model=_model(kind),
        make_optimizer=_adamw,
        device=detect_device("cpu"),
        rank=rank,
    )
    stage = backend.pipeline
    assert stage is not None
    record = _record(backend.model)
    batch = TensorDict({**_batch(), ROUTED_EXPERTS[0]: _shifted(record)}, batch_size=[4])
    dp, dp_rank = backend.context.dp, backend.context.dp_rank
    rows = batch[dp_rank * 4 // dp : (dp_rank + 1) * 4 // dp]
    accumulate(
        backend, [rows[i : i + 1] for i in range(len(rows))], _replayed_micro_loss(backend.model, dp), max_grad_norm=1e9
    )
    grads = {stage.names.whole(n): g.clone() for n, g in whole_gradients(backend).items()}
    return dict(record=record, grads=grads, first_router=stage.links.first_router)


def _one_process_replay() -> dict:
    from tensordict import TensorDict

    from rldock.runtime.flow.columns import ROUTED_EXPERTS

    model = _model("moe")
    record = _record(model)
    batch = TensorDict({**_batch(), ROUTED_EXPERTS[0]: _shifted(record)}, batch_size=[4])
    for i in range(4):
        loss, _ = _replayed_micro_loss(model, 1)(batch[i : i + 1])
        loss.backward()
    return dict(record=record, grads={n: p.grad.clone() for n, p in model.named_parameters()})


def _preference_batch():
    """The batch as 2 DPO pairs (rows 0/1 and 2/3: chosen, rejected) with the reference's logprobs."""
    from tensordict import TensorDict

    batch = _batch()
    ref = -torch.rand(batch["response_ids"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    return TensorDict({**batch, "ref_logprobs": ref}, batch_size=[4])


def _preference_cfg():
    """PP 4 in pairs (micro-batches of 2 rows), the gradient norm unclipped (the test compares raw gradients)."""
    cfg = _cfg(devices=WORLD, **LAYOUTS_PP["pp4"][0], micro_batch_size=2)
    return cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"max_grad_norm": 1e9})})


def _preference_step(rank: int) -> dict:
    """PP 4 running DPO's preference step (training/policy_steps.py) over 2 micro-batches of one pair each:
    the loss is nonlinear in a pair's logprobs, so only the last stage's is the step's."""
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.fsdp import FsdpBackend
    from rldock.runtime.training.policy_steps import preference_step

    cfg = _preference_cfg()
    backend = FsdpBackend(cfg, model=_model("tied"), make_optimizer=_adamw, device=detect_device("cpu"), rank=rank)
    stage = backend.pipeline
    assert stage is not None
    stats = preference_step(backend, _preference_batch(), cfg=cfg)
    grads = {
        stage.names.whole(n): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in backend.model.named_parameters()
    }
    return dict(loss=stats["loss"], grads=grads)


def _one_process_preference() -> dict:
    from rldock.runtime.algorithms.dpo import PreferenceObjective
    from rldock.runtime.engines.policy_passes import micro_batch_scores

    cfg = _preference_cfg()
    algo, model, batch, loss = cfg.algorithm, _model("tied"), _preference_batch(), 0.0
    objective = PreferenceObjective(
        beta=algo.dpo.beta,
        label_smoothing=algo.dpo.label_smoothing,
        kl_estimator=algo.kl_estimator,
        kl_clamp=algo.kl_clamp,
    )
    for micro in batch.split(2):
        scores = micro_batch_scores(model, micro, cfg.training)
        micro_loss, metrics = objective(scores.logprobs, scores.entropy, micro, share=0.5)
        micro_loss.backward()
        loss += metrics["loss"]
    return dict(loss=loss, grads={n: p.grad.clone() for n, p in model.named_parameters()})


def _checkpoint_and_reload(backend, out_dir: Path, rank: int) -> dict:
    """Save the checkpoint's two files as the actor does (rank 0 writes the gathered weights and optimizer
    state), then load them into FSDP over all 4 ranks, with no pipeline: its logprobs and optimizer state."""
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.backend import load_full_weights
    from rldock.runtime.training.fsdp import FsdpBackend

    weights = backend.full_weights()
    backend.save_optimizer(out_dir / "optimizer.pt")
    if rank == 0:
        torch.save(weights, out_dir / "weights.pt")
    dist.barrier()
    fsdp4 = FsdpBackend(
        _cfg(devices=WORLD), model=_model("tied"), make_optimizer=_adamw, device=detect_device("cpu"), rank=rank
    )
    load_full_weights(fsdp4, torch.load(out_dir / "weights.pt"))
    fsdp4.load_optimizer(out_dir / "optimizer.pt", map_location="cpu")
    # gathered before a forward: a pass without backward leaves FSDP's root unsharded, where torch's
    # optimizer state dict does not find the optimizer's parameters (a job saves after its update's backward)
    optimizer = fsdp4.full_optimizer_state()
    with torch.no_grad():
        logprobs = {layout: _logprobs(fsdp4.model, _batch(), layout) for layout in LAYOUTS}
    return dict(logprobs=logprobs, optimizer=optimizer)


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from tensordict import TensorDict

    from rldock.runtime.device import detect_device
    from rldock.runtime.models.context_group import context_group
    from rldock.runtime.training.accumulation import accumulate
    from rldock.runtime.training.fsdp import FsdpBackend
    from rldock_e2e.moe_fixture import whole_gradients

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    results: dict = {}
    for name, (training, kind) in LAYOUTS_PP.items():
        cfg = _cfg(devices=WORLD, **training)
        backend = FsdpBackend(cfg, model=_model(kind), make_optimizer=_adamw, device=detect_device("cpu"), rank=rank)
        stage = backend.pipeline
        assert stage is not None
        context = backend.context
        found: dict = dict(
            stage=stage.links.index, reader=context.reader, counts=backend.counts_passes, writes=backend.writes_results
        )
        found["cp_group"] = (
            None if context_group(backend.model) is None else dist.get_process_group_ranks(context_group(backend.model))
        )
        found["dp_rank"] = context.dp_rank
        with torch.no_grad():
            found["logprobs"] = {layout: _logprobs(backend.model, _batch(), layout) for layout in LAYOUTS}
        batch = TensorDict(_batch(), batch_size=[4])
        dp, dp_rank = context.dp, context.dp_rank
        rows = batch[dp_rank * 4 // dp : (dp_rank + 1) * 4 // dp]  # this data-parallel rank's rows
        micro_batches = [rows[i : i + 1] for i in range(len(rows))]
        if dp == 1:
            assert len(micro_batches) == 4  # the schedule's 4 micro-batches
        order: list[str] = []  # F: a micro-batch's forward, B: its backward, as the schedule runs them
        stats = accumulate(backend, micro_batches, _recording(backend, order, dp), max_grad_norm=1e9)
        found["order"] = "".join(order)
        found["loss"], found["norm"] = stats["loss"], stats["grad_norm"]
        if backend.experts is None:
            grads = (
                (n, p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                for n, p in backend.model.named_parameters()
            )
            found["grads"] = {stage.names.whole(n): g.clone() for n, g in grads}
        else:  # the expert shards gathered over the EP group too
            found["grads"] = {stage.names.whole(n): g.clone() for n, g in whole_gradients(backend).items()}
        found["weights"] = {n: t.clone() for n, t in backend.full_state()}
        results[name] = found
        if name == "pp2_tp2":
            results["reloaded"] = _checkpoint_and_reload(backend, Path(out_dir), rank)
    results["replay"] = _record_and_replay(rank)
    results["preference"] = _preference_step(rank)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("pp-ranks")
    # a file rendezvous in the test's own directory: a probed free port could be taken before rank 0 binds it
    rank_processes.spawn(_rank, args=(str(out_dir / "rendezvous"), str(out_dir)), nprocs=WORLD)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def _one_process(kind: str) -> dict:
    from tensordict import TensorDict

    model = _model(kind)
    with torch.no_grad():
        logprobs = {layout: _logprobs(model, _batch(), layout) for layout in LAYOUTS}
    # the same micro-batches, one after another (a packed pass of the whole batch is another sum order)
    batch, loss = TensorDict(_batch(), batch_size=[4]), 0.0
    for i in range(4):
        micro, _ = _micro_loss(model)(batch[i : i + 1])
        micro.backward()
        loss += float(micro.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    optimizer = _adamw(model.parameters())
    optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    adam = {names[i]: state for i, state in optimizer.state_dict()["state"].items()}
    with torch.no_grad():
        stepped = {layout: _logprobs(model, _batch(), layout) for layout in LAYOUTS}
    return dict(
        logprobs=logprobs, loss=loss, norm=norm, grads=grads, weights=model.state_dict(), adam=adam, stepped=stepped
    )


def test_each_stage_is_a_block_of_ranks_and_the_last_reads_counts_and_writes(ranks):
    # rank = (p dp + d) tp + t
    assert [r["pp4"]["stage"] for r in ranks] == [0, 1, 2, 3]
    assert [r["pp2_fsdp2"]["stage"] for r in ranks] == [0, 0, 1, 1]
    assert [r["pp2_fsdp2"]["reader"] for r in ranks] == [2, 3, 2, 3]  # each data-parallel rank's last stage
    assert [r["pp2_tp2"]["reader"] for r in ranks] == [2, 2, 2, 2]
    assert [r["pp4"]["counts"] for r in ranks] == [False, False, False, True]
    assert [r["pp2_tp2"]["counts"] for r in ranks] == [False, False, True, False]
    # PP 2 x CP 2: each stage's two ranks split every sequence's positions; the last stage's first reads
    assert [r["pp2_cp2"]["stage"] for r in ranks] == [0, 0, 1, 1]
    assert [r["pp2_cp2"]["cp_group"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp2_cp2"]["reader"] for r in ranks] == [2, 2, 2, 2]
    # the reader alone writes a pass's results, so alone measures them (the train-inference gap: the earlier
    # stages' logprobs are zeros)
    for layout in ("pp4", "pp2_fsdp2", "pp2_tp2", "pp2_cp2"):
        assert [r[layout]["writes"] for r in ranks] == [r[layout]["reader"] == rank for rank, r in enumerate(ranks)]


def test_the_update_runs_one_forward_one_backward(ranks):
    """Stage s of p runs min(p - s - 1, m) forwards, then a forward and a backward in turn, then the rest of the
    backwards: the last stage alternates from the start, the first holds p - 1 forwards' activations at most."""
    assert [r["pp4"]["order"] for r in ranks] == ["FFFFBBBB", "FFFBFBBB", "FFBFBFBB", "FBFBFBFB"]
    assert [r["pp2_tp2"]["order"] for r in ranks] == ["FFBFBFBB"] * 2 + ["FBFBFBFB"] * 2
    assert [r["pp2_cp2"]["order"] for r in ranks] == ["FFBFBFBB"] * 2 + ["FBFBFBFB"] * 2


def _assert_one_process_gradients(results: list[dict], expected: dict, what: str) -> None:
    """Each stage's gradients (under the whole model's names) are one process's, and every parameter's gradient
    is on some stage. A tied model's last stage holds the head's copy of the embedding: after the stages' sum,
    its gradient is the embedding's whole one."""
    for got in results:
        for grad_name, grad in got.items():
            tied = grad_name == "lm_head.weight" and grad_name not in expected
            reference = "model.embed_tokens.weight" if tied else grad_name
            torch.testing.assert_close(
                grad, expected[reference], **TOLERANCE, msg=lambda m, at=grad_name: f"{what} {at}: {m}"
            )
    assert set().union(*results) >= set(expected)


@pytest.mark.parametrize("name", LAYOUTS_PP)
def test_the_pipeline_gives_one_process_s_logprobs_loss_gradients_and_step(ranks, name):
    _, kind = LAYOUTS_PP[name]
    expected = _one_process(kind)
    results = [r[name] for r in ranks]
    _assert_one_process_gradients([got["grads"] for got in results], expected["grads"], name)
    for got in results:
        if got["stage"] == max(r["stage"] for r in results):  # the last stage scores
            for layout in LAYOUTS:
                torch.testing.assert_close(got["logprobs"][layout], expected["logprobs"][layout], **TOLERANCE)
        assert got["norm"] == pytest.approx(expected["norm"], rel=1e-9)
        assert got["weights"].keys() == expected["weights"].keys()
        for weight_name, weight in expected["weights"].items():
            torch.testing.assert_close(
                got["weights"][weight_name], weight, **TOLERANCE, msg=lambda m, at=weight_name: f"{name} {at}: {m}"
            )
    # each data-parallel rank's loss, the last stage's on all its stages: together the whole batch's
    by_dp_rank = {got["dp_rank"]: got["loss"] for got in results}
    assert all(got["loss"] == by_dp_rank[got["dp_rank"]] for got in results)
    assert sum(by_dp_rank.values()) == pytest.approx(expected["loss"], rel=1e-9)


def test_a_checkpoint_saved_under_pp2_by_tp2_loads_in_one_process_and_under_fsdp4(ranks, tmp_path_factory):
    """The weights rank 0 wrote load into one process's model and FSDP over 4 ranks with the stepped model's
    logprobs, and the optimizer state it wrote is one process's AdamW state (the tied head's copy left out)."""
    expected = _one_process("tied")
    out_dir = next(Path(p) for p in tmp_path_factory.getbasetemp().glob("pp-ranks*"))
    model = _model("tied")
    model.load_state_dict(torch.load(out_dir / "weights.pt"))
    with torch.no_grad():
        for layout in LAYOUTS:
            torch.testing.assert_close(_logprobs(model, _batch(), layout), expected["stepped"][layout], **TOLERANCE)
            for got in ranks:
                torch.testing.assert_close(
                    got["reloaded"]["logprobs"][layout], expected["stepped"][layout], **TOLERANCE
                )
    saved = torch.load(out_dir / "optimizer.pt")
    assert saved["state"].keys() == expected["adam"].keys()
    for name, state in expected["adam"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(saved["state"][name][key], state[key], **TOLERANCE, msg=f"{name} {key}")
    assert sorted(saved["param_groups"][0]["params"]) == sorted(expected["adam"])
    # FSDP 4 gathered back what it loaded: the same file
    reloaded = ranks[0]["reloaded"]["optimizer"]
    for name, state in saved["state"].items():
        torch.testing.assert_close(reloaded["state"][name]["exp_avg_sq"], state["exp_avg_sq"], **TOLERANCE)


def test_pipeline_stages_record_and_replay_the_whole_model_s_routing_as_one_process(ranks):
    expected = _one_process_replay()
    assert [r["replay"]["first_router"] for r in ranks] == [0, 0, 1, 1]  # one MoE layer a stage
    for got in (r["replay"] for r in ranks):
        # both stages' columns, merged: every rank holds one process's whole record
        assert torch.equal(got["record"], expected["record"])
    _assert_one_process_gradients([r["replay"]["grads"] for r in ranks], expected["grads"], "replay")


def test_dpo_s_preference_step_through_four_stages_is_one_process_s(ranks):
    expected = _one_process_preference()
    for got in (r["preference"] for r in ranks):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-9)  # the last stage's, on every stage
    _assert_one_process_gradients([r["preference"]["grads"] for r in ranks], expected["grads"], "dpo")
