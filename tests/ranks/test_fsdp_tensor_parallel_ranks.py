"""FSDP 2 x TP 2 on 4 real gloo ranks (torch.multiprocessing, CPU): the actor's FsdpBackend on the training
mesh splits the decoder layers' linears over each TP pair, then shards those shards (and the rest) over the
data-parallel pair: 2-D DTensors on one root mesh. A step on each data-parallel rank's rows gives one process's
loss, gradients, gradient norm and weights over the whole batch; the weights the engine gets are whole and
in the Hugging Face layout; the training state swaps out and back (allgather-swap from this layout).

The tolerances: the ranks add the same float32 products in another order (two halves of the batch, TP's
partial sums), so each gradient element differs from one process's by a few ulps of the sums it is made of;
rtol 1e-4 with an atol of 1e-6 (the gradients are of order 1e-3 to 1) holds on any CPU and thread count,
while a layout that averaged over the TP ranks, counted a TP shard twice or dropped a per-head sum is off
by a factor of 2 or more."""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist
from test_fsdp_ranks import RecordingEngine, _adamw, _cfg, _free_port

pytestmark = pytest.mark.ranks

WORLD, DP, TP = 4, 2, 2
ROWS_PER_DP_RANK = 2
TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,  # TP 2 splits 4 heads and 2 KV heads evenly
    num_key_value_heads=2,
    tie_word_embeddings=False,
    max_position_embeddings=64,
)


def _model(architecture: str):
    """Llama's plan splits only linears; Qwen3's also has per-head q_norm and k_norm, whose gradients each TP
    rank holds a part of (resharding/parallel_layout.py `has_partial_gradient`)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        architecture
    ]
    torch.manual_seed(0)
    return model_cls(config_cls(**TINY, head_dim=16)).eval()


ARCHITECTURES = ("llama", "qwen3")


def _batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, TINY["vocab_size"], (DP * ROWS_PER_DP_RANK, 16), generator=generator)


def _whole(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _rank(rank: int, port: int, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    for architecture in ARCHITECTURES:
        _step(architecture, rank, FsdpBackend, detect_device("cpu"), out_dir)
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


def _step(architecture: str, rank: int, backend_class, device, out_dir: str) -> None:
    cfg = _cfg(devices=WORLD, data_parallel_size=DP, tensor_parallel_size=TP, resharding="allgather_swap")
    backend = backend_class(cfg, model=_model(architecture), make_optimizer=_adamw, device=device, rank=rank)
    d = backend.context.dp_rank  # the TP pair of data-parallel rank d computes its rows (TP innermost)
    mine = _batch()[d * ROWS_PER_DP_RANK : (d + 1) * ROWS_PER_DP_RANK]
    loss = backend.model(input_ids=mine, labels=mine).loss
    loss.backward()
    grad_norm = backend.clip_gradients(1e9)
    grads = {name: _whole(p.grad).detach().clone() for name, p in backend.model.named_parameters()}
    placements = {name: len(p.placements) for name, p in backend.model.named_parameters() if hasattr(p, "placements")}
    backend.optimizer.step()
    engine = RecordingEngine()
    backend.to_generation(engine.update_weights)  # gathered whole, then the training state to the host
    ledger = backend.drain_metrics()["ledger"]
    backend.to_training()
    after = float(backend.model(input_ids=mine, labels=mine).loss)
    torch.save(
        {
            "dp_rank": d,
            "reader": backend.context.reader,
            "loss": float(loss),
            "grads": grads,
            "grad_norm": grad_norm,
            "weights": engine.weights,
            "placements": placements,
            "ledger": ledger,
            "loss_after": after,
        },
        Path(out_dir) / f"{architecture}-rank{rank}.pt",
    )


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    """Both architectures on one spawn of the 4 ranks."""
    out_dir = tmp_path_factory.mktemp("fsdp-tp-ranks")
    rank_processes.spawn(_rank, args=(_free_port(), str(out_dir)), nprocs=WORLD)
    return out_dir


@pytest.fixture(params=ARCHITECTURES)
def architecture(request) -> str:
    return request.param


@pytest.fixture
def ranks(spawned, architecture) -> list[dict]:
    return [torch.load(spawned / f"{architecture}-rank{r}.pt") for r in range(WORLD)]


@pytest.fixture
def one_process(architecture) -> dict:
    model = _model(architecture)
    optimizer = _adamw(model.parameters())
    batch = _batch()
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    optimizer.step()
    weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return {"loss": float(loss), "grads": grads, "grad_norm": norm, "weights": weights}


def test_the_ranks_lay_out_dp_by_tp_and_shard_tp_shards_again(ranks):
    # rank = d * tp + t: ranks 0, 1 are data-parallel rank 0's TP pair, read by rank 0
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1] and [r["reader"] for r in ranks] == [0, 0, 2, 2]
    placements = ranks[0]["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == 2  # TP's shard, sharded by FSDP
    assert placements["model.embed_tokens.weight"] == 1  # FSDP's shard of a weight TP leaves whole
    if "model.layers.0.self_attn.q_norm.weight" in placements:  # Qwen3: per-head, replicated over TP
        assert placements["model.layers.0.self_attn.q_norm.weight"] == 1


def test_fsdp_by_tp_gives_one_process_s_loss_gradients_and_step(ranks, one_process):
    # the mean of the two data-parallel halves' token means is the whole batch's (equal rows and lengths)
    losses = {r["dp_rank"]: r["loss"] for r in ranks}
    assert (losses[0] + losses[1]) / 2 == pytest.approx(one_process["loss"], rel=1e-5)
    for got in ranks:
        assert got["grads"].keys() == one_process["grads"].keys()
        for name, expected in one_process["grads"].items():
            torch.testing.assert_close(got["grads"][name], expected, rtol=1e-4, atol=1e-6, msg=name)
        assert got["grad_norm"] == pytest.approx(one_process["grad_norm"], rel=1e-4)
        # the engine's weights: every tensor whole, in the Hugging Face names, one process's step
        assert got["weights"].keys() == one_process["weights"].keys()
        for name, expected in one_process["weights"].items():
            torch.testing.assert_close(got["weights"][name], expected, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.isfinite(torch.tensor(got["loss_after"]))


def test_the_training_state_leaves_the_device_for_generation(ranks):
    for rank, got in enumerate(ranks):
        ledger, prefix = got["ledger"], f"memory/rank{rank}"
        state = sum(ledger[f"{prefix}/after_update/{c}"] for c in ("train_params", "grads", "optimizer_state"))
        during = sum(ledger[f"{prefix}/generation/{c}"] for c in ("train_params", "grads", "optimizer_state"))
        assert state > 0 and during == 0 and ledger[f"{prefix}/generation/host_swap"] == state
