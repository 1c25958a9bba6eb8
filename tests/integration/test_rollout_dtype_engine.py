"""`rollout.dtype: bfloat16` over a float32 master on vLLM's CPU engine: the engine holds bfloat16
weights, a float32 push lands in them, and its sampled logprobs then follow the pushed weights (up
to bfloat16 rounding)."""

from __future__ import annotations

import pytest
import torch

from rldock.config.job import RolloutSpec
from rldock.runtime.device import detect_device
from rldock.runtime.engines.policy import response_logprobs

pytestmark = pytest.mark.integration

EOS = 1  # conftest's tokenizer
PROMPTS = [[4, 5, 13, 6, 14], [7, 14]]


def _param_dtype(worker) -> str:
    return str(next(worker.model_runner.get_model().parameters()).dtype)


def _hf_scores(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long)
    out = torch.tensor([response]), torch.ones(1, len(response), dtype=torch.long)
    with torch.no_grad():
        return response_logprobs(model, *ids, *out, micro_batch_size=1)[0]  # (len(response),)


def test_a_bfloat16_engine_takes_a_float32_push(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine

    engine = VllmRolloutEngine(
        tiny_model_dir,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25, dtype="bfloat16"),
        dtype="float32",
        seed=0,
        max_model_len=64,
        device=detect_device("cpu"),
    )
    try:
        assert engine.dtype == "bfloat16"
        assert engine._llm.collective_rpc(_param_dtype) == ["torch.bfloat16"]
        master = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        generator = torch.Generator().manual_seed(3)
        with torch.no_grad():  # a large step, so the pushed policy is far from the engine's first one
            for param in master.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
        greedy = dict(n=1, max_tokens=8, eos_token_id=EOS, seed=None, greedy=True, logprobs=True)
        (before,) = engine.sample(PROMPTS[:1], **greedy)[0]
        # The check below can fail: the engine's first policy scores its own response far from the
        # pushed policy.
        assert torch.tensor(before.logprobs) != pytest.approx(
            _hf_scores(master, PROMPTS[0], before.token_ids), abs=0.15
        )
        engine.update_weights(master.state_dict().items())
        assert engine._llm.collective_rpc(_param_dtype) == ["torch.bfloat16"]
        for prompt, (sample,) in zip(PROMPTS, engine.sample(PROMPTS, **greedy)):
            expected = _hf_scores(master, prompt, sample.token_ids)
            # bfloat16 keeps 8 bits of mantissa: logprobs agree to a few hundredths, not to float32's 1e-6.
            assert torch.tensor(sample.logprobs) == pytest.approx(expected, abs=0.15)
    finally:
        engine.shutdown()
