"""The KV-cache budget's arithmetic and the engine's sleep/wake sequence around generation."""

import pytest

from rldock.runtime.engines.generation_memory import (
    GenerationMemoryError,
    SleepCycle,
    kv_bytes_per_token,
    kv_cache_budget,
)

GIB = 2**30


def test_kv_bytes_per_token_counts_a_key_and_a_value_per_layer_and_kv_head():
    # Qwen2.5-7B: 28 layers, 4 KV heads of 128, bf16: 56 KiB per token.
    assert kv_bytes_per_token(num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2) == 57344


def test_what_the_swap_frees_goes_to_the_kv_cache():
    # A 7B bf16 engine (15.2 GB of weights) at half of a 64 GiB device: with the training state
    # swapped out the cache gets the whole rest of the share; left resident, that much less.
    common = dict(
        device_bytes=64 * GIB, utilization=0.5, engine_weight_bytes=15 * GIB, min_tokens=4096, bytes_per_token=57344
    )
    swapped = kv_cache_budget(resident_training_bytes=0, **common)
    assert swapped == 17 * GIB
    assert kv_cache_budget(resident_training_bytes=10 * GIB, **common) == swapped - 10 * GIB


def test_a_budget_below_one_sequence_names_the_fields_to_change():
    with pytest.raises(GenerationMemoryError, match="rollout.gpu_memory_utilization 0.5 .* allgather_swap") as caught:
        kv_cache_budget(
            device_bytes=64 * GIB,
            utilization=0.5,
            engine_weight_bytes=15 * GIB,
            resident_training_bytes=17 * GIB,
            min_tokens=4096,
            bytes_per_token=57344,
        )
    assert "algorithm.max_response_length" in str(caught.value)


class RecordingEngine:
    """Test double of vLLM's LLM: records sleep and wake_up calls."""

    def __init__(self):
        self.calls: list[str] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up({tags})")


def _iteration(cycle: SleepCycle, pushes: list[str]) -> None:
    """One RL iteration as the actor runs it: generate, sleep, train, push the new weights."""
    cycle.before_generation()
    cycle.after_generation()
    cycle.before_weight_update()
    pushes.append("update")
    cycle.after_weight_update()


def test_level_1_wakes_weights_for_the_update_and_the_kv_cache_for_generation():
    engine, pushes = RecordingEngine(), []
    cycle = SleepCycle(engine, level=1, enabled=True)
    _iteration(cycle, pushes)
    _iteration(cycle, pushes)
    assert engine.calls == [
        "sleep(1)",
        "wake_up(['weights'])",
        "wake_up(['kv_cache'])",
        "sleep(1)",
        "wake_up(['weights'])",
    ]
    assert cycle.state == "weights" and pushes == ["update", "update"]


def test_level_2_pushes_the_weights_again_when_generating_twice_without_an_update():
    engine, pushes = RecordingEngine(), []
    cycle = SleepCycle(engine, level=2, enabled=True)

    def reload():
        pushes.append("reload")
        cycle.after_weight_update()

    cycle.reload = reload
    cycle.before_generation()  # a first sampling round (DAPO); _iteration's is the second
    cycle.after_generation()
    _iteration(cycle, pushes)
    cycle.before_generation()  # the next iteration: the update brought fresh weights
    assert pushes == ["reload", "update"]
    assert engine.calls == [
        "sleep(2)",
        "wake_up(['weights'])",
        "wake_up(['kv_cache'])",
        "sleep(2)",
        "wake_up(['weights'])",
        "wake_up(['kv_cache'])",
    ]


def test_on_cpu_the_same_sequence_runs_without_engine_calls():
    engine, device = RecordingEngine(), RecordingEngine()
    cpu = SleepCycle(engine, level=1, enabled=False)
    accelerator = SleepCycle(device, level=1, enabled=True)
    for cycle in (cpu, accelerator):
        _iteration(cycle, [])
    assert engine.calls == [] and cpu.log == accelerator.log == ["sleep(level=1)", "wake_up(tags=['weights'])"]


def test_level_2_without_a_reload_refuses_to_generate_on_stale_weights():
    cycle = SleepCycle(RecordingEngine(), level=2, enabled=True)
    cycle.after_generation()
    with pytest.raises(RuntimeError, match="discarded the engine's weights"):
        cycle.before_generation()
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        SleepCycle(RecordingEngine(), level=3, enabled=True)
