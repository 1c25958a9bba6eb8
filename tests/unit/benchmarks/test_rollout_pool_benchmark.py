"""The rollout pool benchmark's summary (no jobs run): samples per second over all iterations and after the
first, what each pool engine generated, and the pool's weight load and rank 0's copy per version."""

from __future__ import annotations

from rldock_benchmarks.rollout_pool import summary


def test_samples_per_second_and_the_pools_loads():
    def record(seconds: float, load: float | None) -> dict:
        pool = {"rollout/pool_engine_samples": {"engine0": 4, "engine1": 4}}
        loads = {} if load is None else {"rollout/pool_weights_load_s": load, "rollout/pool_publish_copy_s": load / 4}
        return {"timing": {"iteration": seconds}, **pool, **loads}

    out = summary([record(10.0, None), record(2.0, 0.5), record(2.0, 0.25)], samples_per_iteration=8)
    assert out["samples_per_s"] == 24 / 14.0 and out["samples_per_s_after_first"] == 16 / 4.0
    assert out["pool_engine_samples"][1] == {"engine0": 4, "engine1": 4}
    assert out["weights_load_s"] == {"median": 0.375, "max": 0.5}
    assert out["publish_copy_s"] == {"median": 0.09375, "max": 0.125}  # sums of powers of two: exact
    assert "weights_load_s" not in summary([record(1.0, None), record(1.0, None)], samples_per_iteration=8)
