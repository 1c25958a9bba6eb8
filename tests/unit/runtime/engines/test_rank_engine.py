"""An actor rank's generation engine before any vLLM starts: who holds one, what a rank without one
does with an update's weights, and the replica's devices set only while the engine starts."""

from __future__ import annotations

import os
import types

import pytest
import torch

from rldock.config.job import JobConfig
from rldock.runtime.engines import rank_engine
from rldock.runtime.engines.rank_engine import RankEngine


def _cfg(generation_tp: int) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        rollout={"tensor_parallel_size": generation_tp},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 3,
            "max_response_length": 3,
            "learning_rate": 1e-3,
        },
    )


def _engine(rank: int, *, generation_tp: int = 2, world_size: int = 4, needed: bool = True) -> RankEngine:
    model = torch.nn.Linear(2, 2)
    device = types.SimpleNamespace(torch_device="cpu", kind="cpu")
    return RankEngine(
        _cfg(generation_tp),
        model=model,
        policy_dir="/nonexistent",
        device=device,  # type: ignore[arg-type]
        rank=rank,
        world_size=world_size,
        needed=needed,
    )


def test_the_first_rank_of_each_replica_holds_the_engine_and_generates_the_replicas_share():
    assert [_engine(rank).holds_engine for rank in range(4)] == [True, False, True, False]
    assert not _engine(0, needed=False).holds_engine  # DPO: no engine anywhere
    assert _engine(0).replica_samples == 4 * 2 // 4 * 2


def test_a_rank_without_an_engine_draws_the_weights_and_refuses_to_generate():
    peer = _engine(1)
    drawn = []
    peer.push(drawn.append(name) or (name, tensor) for name, tensor in peer.weights())
    assert drawn == ["weight", "bias"]  # drawn to the end: FSDP gathers each tensor as it is drawn
    with pytest.raises(RuntimeError, match=r"actor rank 1 holds no engine .* ranks \[0, 2\]"):
        peer.held()


def test_the_replicas_devices_are_set_while_the_engine_starts_and_put_back_after(monkeypatch):
    monkeypatch.setenv("RLDOCK_TEST_DEVICES", "0")
    monkeypatch.delenv("RLDOCK_TEST_ADDED", raising=False)
    seen = {}

    class Engine:
        def __init__(self, *args, **kwargs):
            seen.update({name: os.environ.get(name) for name in ("RLDOCK_TEST_DEVICES", "RLDOCK_TEST_ADDED")})

    monkeypatch.setattr(rank_engine, "VllmRolloutEngine", Engine)
    monkeypatch.setattr(rank_engine, "engine_kv_cache_bytes", lambda *args, **kwargs: 1)
    attached = []
    holder = _engine(0)
    holder.start({"RLDOCK_TEST_DEVICES": "0,1", "RLDOCK_TEST_ADDED": "x"}, attach=lambda e, weights: attached.append(e))
    assert seen == {"RLDOCK_TEST_DEVICES": "0,1", "RLDOCK_TEST_ADDED": "x"}
    assert os.environ["RLDOCK_TEST_DEVICES"] == "0" and "RLDOCK_TEST_ADDED" not in os.environ
    assert attached == [holder.engine] and holder.held() is holder.engine
    _engine(1).start({"RLDOCK_TEST_DEVICES": "0,1"}, attach=lambda e, weights: attached.append(e))
    assert len(attached) == 1  # a replica's other rank starts nothing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int64])
def test_a_published_tensor_keeps_its_bits_dtype_and_shape_as_numpy_bytes(dtype):
    """The pool's weights travel as numpy arrays of their bytes (Ray keeps those out of band); numpy has no
    bfloat16, so the bytes are kept, not the values. A transposed (non-contiguous) and a 0-dim tensor too."""
    import pickle

    import numpy as np

    from rldock.runtime.engines.rank_engine import HostTensor

    source = (torch.randn(3, 5) * 1000).to(dtype)
    for tensor in (source, source.t(), source[0, 0]):
        host = HostTensor.of(tensor)
        assert host.bits.dtype == np.uint8 and host.bits.ndim == 1
        # out of band, as Ray's object store keeps the bytes, and read-only, as a reader maps them
        buffers: list = []
        pickled = pickle.dumps(host, protocol=5, buffer_callback=buffers.append)
        back = pickle.loads(pickled, buffers=[memoryview(b.raw().tobytes()) for b in buffers]).tensor()
        assert buffers and back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)
    cast = HostTensor.of(source.float(), dtype=dtype).tensor()  # published in the engines' dtype
    assert cast.dtype == dtype and torch.equal(cast, source.float().to(dtype))
