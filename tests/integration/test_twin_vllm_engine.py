"""The rollout engine on the npu twin: the device seam gives the twin vLLM's CPU engine in place of
vllm-ascend (device.TWIN_SUBSTITUTES), and that engine takes its weights from a policy on `npu:0`
in memory, after which its greedy output is the npu policy's. At generation TP 2 its TP worker
processes see the replica's devices the trainer hands the engine rank, and take npu weights too."""

from __future__ import annotations

import sys

import pytest
import torch

from rldock.config.rollout import RolloutSpec
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

    engine = VllmRolloutEngine(
        tiny_model_dir,
        rollout=RolloutSpec(temperature=1.0, top_p=1.0, cpu_kv_cache_gib=0.25),
        dtype="float32",
        seed=0,
        max_model_len=64,
        device=device,
    )
    try:
        engine.update_weights(device_model.state_dict().items())  # npu tensors into the CPU engine
        after = engine.sample(PROMPTS, n=1, max_tokens=10, eos_token_id=EOS, seed=None, greedy=True)
    finally:
        engine.shutdown()
    assert not dist.is_initialized()

    for prompt, (completion,) in zip(PROMPTS, after):
        ids = torch.tensor([prompt])
        expected = host_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert completion.token_ids == expected


def _visible_devices_of_worker(worker) -> str | None:
    """Run by vLLM in each TP worker process (pickled by value: the workers cannot import tests)."""
    import os

    return os.environ.get("ASCEND_RT_VISIBLE_DEVICES")


def test_twin_tp2_engine_workers_see_the_replica_devices_the_trainer_hands_over(npu_twin, tiny_model_dir, monkeypatch):
    """Generation TP 2 on the twin: the engine rank (Ray put it on device 3, its peer on 1) gets the
    replica's devices, its own first, and vLLM's TP worker processes inherit exactly that list."""
    from ray import cloudpickle
    from transformers import AutoModelForCausalLM

    from rldock.runtime.engines.replica_devices import RankDevice, engine_environments
    from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine

    device = detect_device("npu", index=0)
    replica = [RankDevice(node_id="node", device_kind=device.kind, device_ids=(d,)) for d in ("3", "1")]
    (env,) = engine_environments(replica, generation_tp=2).values()
    assert env == {"ASCEND_RT_VISIBLE_DEVICES": "3,1"}
    for name, value in env.items():  # what ActorWorker.join_group does on the engine rank
        monkeypatch.setenv(name, value)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # a policy the engine did not start from, so the push must reach both workers
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = VllmRolloutEngine(
        tiny_model_dir,
        rollout=RolloutSpec(cpu_kv_cache_gib=0.25, tensor_parallel_size=2),
        dtype="float32",
        seed=0,
        max_model_len=64,
        device=device,
    )
    try:
        assert engine._llm.collective_rpc(_visible_devices_of_worker) == ["3,1", "3,1"]
        engine.update_weights({k: v.to(device.torch_device) for k, v in model.state_dict().items()}.items())
        after = engine.sample(PROMPTS, n=1, max_tokens=6, eos_token_id=EOS, seed=None, greedy=True)
    finally:
        engine.shutdown()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    for prompt, (completion,) in zip(PROMPTS, after):
        ids = torch.tensor([prompt])
        expected = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=6,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
        assert completion.token_ids == expected
