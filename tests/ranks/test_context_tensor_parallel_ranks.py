"""CP 2 x TP 2 on 4 real gloo ranks (torch.multiprocessing, CPU), in both CP modes: the actor's FsdpBackend
on the training mesh (dp 1, cp 2, tp 2) splits the decoder layers' linears over each TP pair, gives the
attention the CP mode over each TP rank's CP peers, and shards the rest over the CP pair. Each rank's
logprobs, entropy and loss on a packed batch, on padded rows and on trimmed rows are one process's, and
its gradients and gradient norm after the backend's sums (FSDP's over CP, the per-head partial sums over
TP) are one process's too.

Ulysses runs on a Qwen3 model of 8 heads and 4 KV heads: a TP rank attends with 4 and 2, which CP 2 splits
again, and its per-head q_norm/k_norm gradients are TP-partial. Ring runs on a Qwen2 model of 6 heads and
2 KV heads: a TP rank's 3 and 1 do not divide by CP 2, and ring keeps them whole.

Everything runs in float64, so the comparison measures the layout, not float32 rounding: the ranks add the
same products as one process in another order (TP's partial sums, the CP shares, the ring's merged blocks),
a few ulps of float64 times the depth of the sums; 1e-9 holds on any CPU and thread count, while a CP
group over the wrong ranks, a TP rank attending with another's heads or a missed sum is off by 1e-2 and up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist
from test_context_parallel_ranks import _grads, _scores_and_loss
from test_fsdp_ranks import _adamw, _cfg

from rldock_e2e.scored_batch import LAYOUTS, scored_batch

pytestmark = pytest.mark.ranks

WORLD, CP, TP = 4, 2, 2
TOLERANCE = dict(rtol=1e-9, atol=1e-11)
SHAPE = dict(vocab_size=48, intermediate_size=96, num_hidden_layers=2, head_dim=8, max_position_embeddings=64)
# mode -> (architecture, heads, KV heads, hidden size): Ulysses' heads divide by TP x CP, ring's do not
MODELS = {"ulysses": ("qwen3", 8, 4, 64), "ring": ("qwen2", 6, 2, 48)}


def _model(mode: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    architecture, heads, kv_heads, hidden = MODELS[mode]
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        architecture
    ]
    config = config_cls(
        **SHAPE,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return model_cls(config).double().eval()


def _batch() -> dict[str, torch.Tensor]:
    return scored_batch(1, vocab_size=SHAPE["vocab_size"])


def _rank(rank: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    results: dict = {}
    for mode in MODELS:
        cfg = _cfg(
            devices=WORLD,
            data_parallel_size=1,
            context_parallel_size=CP,
            tensor_parallel_size=TP,
            context_parallel_mode=mode,
        )
        backend = FsdpBackend(cfg, model=_model(mode), make_optimizer=_adamw, device=detect_device("cpu"), rank=rank)
        context = backend.context
        results[mode, "layout"] = dict(dp_rank=context.dp_rank, reader=context.reader, cp=context.cp)
        for layout in LAYOUTS:
            backend.model.zero_grad()
            logprobs, entropy, loss = _scores_and_loss(backend.model, _batch(), layout)
            loss.backward()
            norm = backend.clip_gradients(1e9)
            results[mode, layout] = dict(
                logprobs=logprobs.detach(), entropy=entropy, loss=float(loss), norm=norm, grads=_grads(backend.model)
            )
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("cp-tp-ranks")
    # a file rendezvous in the test's own directory: a probed free port could be taken before rank 0 binds it
    rank_processes.spawn(_rank, args=(str(out_dir / "rendezvous"), str(out_dir)), nprocs=WORLD)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def _one_process(mode: str, layout: str) -> dict:
    model = _model(mode)
    logprobs, entropy, loss = _scores_and_loss(model, _batch(), layout)
    loss.backward()
    grads = _grads(model)
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()])))
    return dict(logprobs=logprobs.detach(), entropy=entropy, loss=float(loss), norm=norm, grads=grads)


def test_one_data_parallel_rank_s_cp_by_tp_ranks_share_its_one_read(ranks):
    for mode in MODELS:  # rank = (d cp + c) tp + t: all four are data-parallel rank 0's, read by rank 0
        assert [r[mode, "layout"] for r in ranks] == [dict(dp_rank=0, reader=0, cp=CP)] * WORLD


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODELS)
def test_cp_by_tp_gives_one_process_s_scores_loss_and_gradients(ranks, mode, layout):
    expected = _one_process(mode, layout)
    for got in ranks:
        result = got[mode, layout]
        torch.testing.assert_close(result["logprobs"], expected["logprobs"], **TOLERANCE)
        torch.testing.assert_close(result["entropy"], expected["entropy"], **TOLERANCE)
        assert result["loss"] == pytest.approx(expected["loss"], rel=1e-9)
        assert result["norm"] == pytest.approx(expected["norm"], rel=1e-9)
        assert result["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(result["grads"][name], grad, **TOLERANCE, msg=f"{mode} {layout} {name}")
