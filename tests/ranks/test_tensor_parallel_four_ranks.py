"""Tensor parallelism beyond two ranks: the decoder TP plan at TP 4 over four gloo ranks
(torch.multiprocessing) for each architecture with a plan (Llama, Qwen2, Qwen3): the split model
computes the unsplit model's logits and loss, and after the update (per-head gradients completed,
clipping over the split model) its weights equal the unsplit model's after the same step."""

from __future__ import annotations

import json
import socket

import pytest
import rank_processes
import torch
import torch.distributed as dist

pytestmark = pytest.mark.ranks

WORLD = 4
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def _tiny(architecture: str, seed: int):
    """8 heads and 4 KV heads of 16, MLP 128: every split dimension divides by 4."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }[architecture]
    config = config_cls(
        vocab_size=40,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return model_cls(config)


def _full(tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()


def _check(architecture: str) -> dict:
    from torch.distributed.tensor import DTensor

    from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh
    from rldock.runtime.resharding.parallelize import apply_gradients, parallelize_decoder

    mesh = ParallelMesh(MeshShape(dp=1, tp=WORLD), "cpu")
    reference, split = _tiny(architecture, seed=3), parallelize_decoder(_tiny(architecture, seed=3), mesh)
    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))  # (B, T)
    results = {}
    for name, model in (("reference", reference), ("split", split)):
        # SGD: the step is the clipped gradient itself (an Adam first step is about its sign, which
        # rounding flips where a gradient is near 0)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        if name == "reference":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
        else:
            apply_gradients(model, optimizer, mesh, max_grad_norm=0.5)
        results[name] = (
            out.logits.detach(),
            out.loss.item(),
            {n: _full(p).clone() for n, p in model.named_parameters()},
        )
    (logits, loss, weights), (split_logits, split_loss, split_weights) = results["reference"], results["split"]
    sharded = [n for n, p in split.named_parameters() if isinstance(p, DTensor) and p.to_local().shape != p.shape]
    return {
        "logits_error": (logits - split_logits).abs().max().item(),
        "loss_error": abs(loss - split_loss),
        "weights_error": max((weights[n] - split_weights[n]).abs().max().item() for n in weights),
        "num_sharded": len(sharded),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    results = {architecture: _check(architecture) for architecture in ARCHITECTURES}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    # Every rank's last collective has arrived before any rank tears the group down: a rank that
    # exits while its peer's gloo thread still talks to it aborts ("terminate called without an
    # active exception", SIGABRT, seen once in a CI run).
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp4")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rank_processes.spawn(_worker, args=(port, str(out)), nprocs=WORLD)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_tp4_computes_and_updates_like_the_unsplit_model(ranks, architecture):
    for result in (rank[architecture] for rank in ranks):
        # per layer the q/k/v/o/gate/up/down weights, and Qwen2's q/k/v biases
        assert result["num_sharded"] == 2 * (10 if architecture == "qwen2" else 7)
        assert result["logits_error"] < 1e-5 and result["loss_error"] < 1e-5
        assert result["weights_error"] < 1e-5
