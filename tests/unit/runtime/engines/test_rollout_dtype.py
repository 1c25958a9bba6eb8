"""`rollout.dtype`: the engine's dtype apart from the trainer's, and the cast on every weight push."""

import pytest
import torch

from rldock.config.rollout import RolloutSpec, generation_dtype
from rldock.runtime.engines.generation_memory import SleepCycle
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine


@pytest.mark.parametrize(
    "model_dtype, rollout_dtype, on_cpu, expected",
    [
        ("float32", None, True, "float32"),  # the CPU demo's engine, as it always ran
        ("bfloat16", None, True, "float32"),
        ("bfloat16", None, False, "bfloat16"),  # an accelerator follows model.dtype
        ("float32", "bfloat16", False, "bfloat16"),  # bfloat16 generation over a float32 master
        ("float32", "bfloat16", True, "bfloat16"),
    ],
)
def test_generation_dtype(model_dtype, rollout_dtype, on_cpu, expected):
    assert generation_dtype(model_dtype=model_dtype, rollout_dtype=rollout_dtype, on_cpu=on_cpu) == expected


def test_rollout_dtype_is_unset_by_default_and_refuses_other_names():
    assert RolloutSpec().dtype is None
    with pytest.raises(ValueError, match="dtype"):
        RolloutSpec(dtype="float64")


class RecordingLlmDouble:
    """Stands in for vLLM's LLM: records what a worker's reload would receive."""

    def __init__(self):
        self.received: list[tuple[str, torch.dtype, str]] = []

    def collective_rpc(self, method, args):
        self.received = [(name, tensor.dtype, tensor.device.type) for name, tensor in args[0]]

    def reset_prefix_cache(self) -> bool:
        return True


def _engine_double(dtype: str, tensor_parallel_size: int) -> VllmRolloutEngine:
    engine = VllmRolloutEngine.__new__(VllmRolloutEngine)  # no vLLM: only update_weights runs
    engine.dtype, engine.tensor_parallel_size, engine.model_type = dtype, tensor_parallel_size, "qwen2"
    engine.weights_by_plan = False  # through vLLM's reload, which the double records
    engine._llm = RecordingLlmDouble()
    engine.memory = SleepCycle(engine._llm, level=1, enabled=False)
    return engine


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
def test_a_float32_push_reaches_a_bfloat16_engine_as_bfloat16(tensor_parallel_size):
    engine = _engine_double("bfloat16", tensor_parallel_size)
    master = torch.nn.Linear(4, 4)  # float32, requires grad: as the trainer holds it
    engine.update_weights(master.state_dict().items())
    assert engine._llm.received == [("weight", torch.bfloat16, "cpu"), ("bias", torch.bfloat16, "cpu")]


def test_a_push_in_the_engines_dtype_is_not_cast():
    engine = _engine_double("float32", 1)
    engine.update_weights([("weight", torch.ones(2))])
    assert engine._llm.received == [("weight", torch.float32, "cpu")]
