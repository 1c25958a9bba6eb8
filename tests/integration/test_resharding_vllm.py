"""Resharding into a real vLLM engine (CPU, generation TP 1): the gathered training weights load
in place, the engine generates what the trained HF model generates while the whole training state
is swapped out, and training resumes on the same tensors afterwards."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist

from rldock.config.rollout import RolloutSpec
from rldock.runtime.device import detect_device

pytestmark = pytest.mark.integration

EOS = 1  # conftest's tokenizer
PROMPTS = [[4, 5, 13, 6, 14], [7, 14], [9, 9, 9, 3]]


def _train_step(model, optimizer, mesh, seed: int) -> float:
    from rldock.runtime.resharding.parallelize import apply_gradients

    tokens = torch.randint(3, model.config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    apply_gradients(model, optimizer, mesh, max_grad_norm=1.0)
    return loss.item()


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, eos_token_id=EOS, pad_token_id=0
    )[0, len(prompt) :].tolist()


def test_reshard_into_vllm_with_training_state_swapped_out(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.resharding.flow import Resharder
    from rldock.runtime.resharding.ledger import train_state_bytes
    from rldock.runtime.resharding.parallel_layout import ParallelLayout, ReshardPlan
    from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh
    from rldock.runtime.resharding.parallelize import parallelize_decoder

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # As in the actor: the trainer group first, then the engine, which adopts it.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    engine = VllmRolloutEngine(
        tiny_model_dir,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25),
        dtype="float32",
        seed=0,
        max_model_len=64,
        device=detect_device("cpu"),
    )
    try:
        plan = ReshardPlan(train=ParallelLayout(1, 1), generate=ParallelLayout(1, 1))
        mesh = ParallelMesh(MeshShape(dp=1), "cpu")
        model = parallelize_decoder(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)  # large: the weights must visibly move
        resharder = Resharder(
            model=model,
            optimizer=optimizer,
            mesh=mesh,
            plan=plan,
            rank=0,
            mode="allgather_swap",
            bucket_bytes=1 << 16,
            load_weights=engine.update_weights,
            generation_tensors=list,
        )
        _train_step(model, optimizer, mesh, seed=0)
        expected = [_hf_greedy(model, prompt) for prompt in PROMPTS]
        params = {name: p.detach().clone() for name, p in model.named_parameters()}

        greedy = dict(n=1, max_tokens=8, eos_token_id=EOS, seed=None, greedy=True)
        before = [c.token_ids for (c,) in engine.sample(PROMPTS, **greedy)]
        assert before != expected  # the engine still has the initial weights: the check can fail

        resharder.to_generation()
        generation = next(e for e in resharder.ledger if e["stage"] == "generation")
        assert train_state_bytes(generation) == 0 and generation["device_bytes"]["temp_buffer"] == 0
        out = engine.sample(PROMPTS, **greedy)
        assert [c.token_ids for (c,) in out] == expected

        resharder.begin_update()
        resharder.finish_update_swap()
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), params[name]), name
        assert torch.isfinite(torch.tensor(_train_step(model, optimizer, mesh, seed=1)))
    finally:
        engine.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
