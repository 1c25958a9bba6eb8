"""LoRA end to end: a real GRPO job (local Ray, vLLM rollout, DDP over two ranks with one engine of
generation TP 2 for both) trains only the adapters, with the reference pass on the actors (adapters
off, no reference ranks), and resumes from its adapters; the engine samples with the merged weights
its old-logprob pass runs on (the float32 gap, every iteration); and the merged weights a sync hands
to vLLM give the trained policy's logprobs."""

from __future__ import annotations

from pathlib import Path

import jobs  # tests/jobs.py
import pytest
import torch
import yaml
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

EOS = 1  # conftest's tokenizer
PROMPTS = [[4, 5, 13, 6, 14], [7, 14], [9, 9, 9, 3]]
TARGETS = ["q_proj", "v_proj", "up_proj"]


def _job(model_dir: Path, iterations: int) -> dict:
    return {
        "name": "it-lora",
        "seed": 1,
        "iterations": iterations,
        "model": {"path": str(model_dir), "builder": "tiny-qwen2"},
        "algorithm": {
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 5e-3,
            "kl_coef": 0.05,
        },
        "training": {
            "data_parallel_size": 2,
            "micro_batch_size": 8,
            "lora": {"rank": 4, "alpha": 8, "target_modules": TARGETS},
        },
        "resources": {"devices_per_node": 2},  # two actor ranks; no reference ranks under LoRA
        "rollout": {"tensor_parallel_size": 2},  # rank 0's engine; rank 1 holds none and loads nothing
        "monitoring": {"mismatch": {"max_kl": 10, "action": "warn"}},  # the engine's gap, measured only
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 2, "keep_last": 3},
    }


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_a_lora_job_updates_only_adapted_weights_and_resumes_from_its_adapters(tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(_job(tmp_path / "model", iterations=2)))
    output = tmp_path / "run"
    jobs.run(config, output, max_restarts=None)
    # a fresh process loads the saved adapters
    records = jobs.run(config, output, {"iterations": 3}, resume=True, max_restarts=None).records
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(r["kl"] >= 0 for r in records) and records[-1]["kl"] > 0  # the reference pass ran (adapters off)
    for record in records:  # after each update the engine holds the merged adapters: no gap but float32's
        assert record["rollout/num_engines"] == 1
        jobs.check_float32_gap(record)
    base = _weights(tmp_path / "model")
    checkpoints = output / "checkpoints"
    second, third = _weights(checkpoints / "iter-000002" / "policy"), _weights(checkpoints / "iter-000003" / "policy")
    adapted = {name for name in base if any(name.endswith(f".{t}.weight") for t in TARGETS)}  # not biases
    assert adapted and adapted < base.keys()
    for name, tensor in base.items():  # the merged policy: base weights moved only where adapters sit
        if name in adapted:
            assert not torch.equal(third[name], tensor), name
        else:
            assert torch.equal(third[name], tensor), name
    assert any(not torch.equal(second[name], third[name]) for name in adapted)  # iteration 3 trained on
    assert (checkpoints / "iter-000003" / "adapter" / "adapter_config.json").is_file()


def test_the_sync_gives_vllm_the_merged_weights(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from rldock.config.rollout import RolloutSpec
    from rldock.config.training import LoraSpec
    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
    from rldock.runtime.models.lora import adapters_off, add_lora, merged_weights

    model = add_lora(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), LoraSpec(rank=4, alpha=8)
    )
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    for seed in range(3):  # the adapters must visibly move the policy
        tokens = torch.randint(3, model.config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(seed))
        optimizer.zero_grad()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
    engine = VllmRolloutEngine(
        tiny_model_dir,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25),
        dtype="float32",
        seed=0,
        max_model_len=64,
        device=detect_device("cpu"),
    )
    try:
        engine.update_weights(merged_weights(model))
        completions = [
            group[0]
            for group in engine.sample(PROMPTS, n=1, max_tokens=6, eos_token_id=EOS, seed=0, greedy=True, logprobs=True)
        ]
    finally:
        engine.shutdown()
    model.eval()
    for prompt, completion in zip(PROMPTS, completions):
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            trained = _token_logprobs(model(input_ids=ids).logits, ids, len(prompt))
            with adapters_off(model):
                reference = _token_logprobs(model(input_ids=ids).logits, ids, len(prompt))
        torch.testing.assert_close(torch.tensor(completion.logprobs), trained, rtol=0, atol=1e-4)
        assert (trained - reference).abs().max() > 1e-2  # so the comparison tells merged from base


def _token_logprobs(logits: torch.Tensor, ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Logprob of each response token under `logits` (1, L, V) of the sequence `ids` (1, L)."""
    logprobs = torch.log_softmax(logits[0, prompt_length - 1 : -1].float(), dim=-1)  # (R, V)
    return logprobs.gather(1, ids[0, prompt_length:, None])[:, 0]
