"""The rollout engine on the npu twin: the device seam gives the twin vLLM's CPU engine in place of
vllm-ascend (device.TWIN_SUBSTITUTES), and that engine takes its weights from a policy on `npu:0`
in memory, after which its greedy output is the npu policy's."""

from __future__ import annotations

import pytest
import torch

from rldock.config.job import RolloutSpec
from rldock.runtime.device import detect_device

pytestmark = pytest.mark.integration

EOS = 1  # conftest's tokenizer: <pad>=0, <eos>=1, <bos>=2, then characters
PROMPTS = [[4, 5, 13, 6, 14], [7, 14], [9, 9, 9, 3]]


def test_twin_engine_runs_on_cpu_and_takes_weights_from_the_device(npu_twin, tiny_model_dir):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine

    device = detect_device("npu", index=0)
    assert device.twin and device.engine_kind == "cpu"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    host_model = model
    device_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    device_model.load_state_dict(host_model.state_dict())
    device_model.to(device.torch_device)

    engine = VllmRolloutEngine(tiny_model_dir, rollout=RolloutSpec(temperature=1.0, top_p=1.0, cpu_kv_cache_gib=0.25),
                               dtype="float32", seed=0, max_model_len=64, device=device)
    try:
        engine.update_weights(device_model.state_dict().items())  # npu tensors into the CPU engine
        after = engine.sample(PROMPTS, n=1, max_tokens=10, eos_token_id=EOS, seed=None, greedy=True)
    finally:
        engine.shutdown()
    assert not dist.is_initialized()

    for prompt, (completion,) in zip(PROMPTS, after):
        ids = torch.tensor([prompt])
        expected = host_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                       do_sample=False, eos_token_id=EOS, pad_token_id=0)[0, len(prompt):].tolist()
        assert completion.token_ids == expected
