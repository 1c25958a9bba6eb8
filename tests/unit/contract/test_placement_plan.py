"""The placement plan: one bundle per device, every actor rank on its own device, the other device
workers first fit (half a device each when colocated, a whole one when separate)."""

from __future__ import annotations

import pytest

from rldock.contract.placement import Seat, SeatRequest, plan_placement


def _plan(mode="colocated", *, actors=2, references=2, critics=0, reward_model=False):
    others = [
        SeatRequest("reference", references),
        SeatRequest("critic", critics, distinct=True),
        SeatRequest("reward_model", int(reward_model)),
    ]
    return plan_placement(accelerator="NPU", num_actor_ranks=actors, others=others, mode=mode)


def test_colocated_puts_each_reference_rank_on_an_actor_device():
    plan = _plan()
    assert plan.bundles == ({"NPU": 1.0, "CPU": 2.0}, {"NPU": 1.0, "CPU": 2.0})
    assert plan.actors == (Seat(0, 0.5), Seat(1, 0.5))
    assert plan.group("reference") == (Seat(0, 0.5), Seat(1, 0.5))
    assert plan.workers_on(1) == ["actor 1", "reference 1"]


def test_tensor_parallel_peers_get_distinct_devices_and_the_critic_ranks_take_the_left_over_halves():
    # DP 2 x TP 2: four actor devices, two reference halves, then the two critic ranks fill the two
    # halves still free instead of opening a device; the reward model opens one.
    plan = _plan(actors=4, references=2, critics=2, reward_model=True)
    assert [s.bundle for s in plan.actors] == [0, 1, 2, 3]
    assert [s.bundle for s in plan.group("reference")] == [0, 1]
    assert plan.group("critic") == (Seat(2, 0.5), Seat(3, 0.5))
    assert plan.group("reward_model") == (Seat(4, 0.5),)
    assert plan.workers_on(2) == ["actor 2", "critic 0"]
    assert plan.num_devices == 5
    assert all(b["CPU"] == 2.0 for b in plan.bundles[:4]) and plan.bundles[4]["CPU"] == 1.0


def test_data_parallel_critic_ranks_never_share_a_device():
    # DP 2 colocated: actor + reference on each DP device; the two critic ranks form a DDP group,
    # which NCCL/HCCL refuse on one device, so each opens a device of its own.
    plan = _plan(actors=2, references=2, critics=2)
    assert plan.group("critic") == (Seat(2, 0.5), Seat(3, 0.5))
    assert plan.workers_on(2) == ["critic 0"] and plan.workers_on(3) == ["critic 1"]
    assert plan.num_devices == 4
    # a reward model takes a half a critic left free
    assert _plan(actors=2, references=2, critics=2, reward_model=True).group("reward_model") == (Seat(2, 0.5),)


@pytest.mark.parametrize(
    ("critics", "reward_model", "devices"), [(0, False, 1), (1, False, 2), (0, True, 2), (1, True, 2)]
)
def test_colocated_critic_and_reward_model_share_one_extra_device(critics, reward_model, devices):
    plan = _plan(actors=1, references=1, critics=critics, reward_model=reward_model)
    assert plan.num_devices == devices
    if critics and reward_model:
        assert plan.workers_on(1) == ["critic 0", "reward_model 0"]


def test_separate_gives_every_worker_a_whole_device():
    plan = _plan("separate", actors=2, references=2, critics=2)
    seats = (*plan.actors, *plan.group("reference"), *plan.group("critic"))
    assert [s.bundle for s in seats] == [0, 1, 2, 3, 4, 5]
    assert {s.share for s in seats} == {1.0}
    assert plan.bundles[5] == {"NPU": 1.0, "CPU": 1.0}


def test_no_reference_leaves_the_actor_devices_half_used():
    plan = _plan(actors=2, references=0)
    assert plan.num_devices == 2 and plan.workers_on(0) == ["actor 0"]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown placement mode 'spread'"):
        _plan("spread")
    with pytest.raises(ValueError, match="at least one actor rank"):
        _plan(actors=0)
    with pytest.raises(ValueError, match="no negative count"):
        _plan(critics=-1)


@pytest.mark.parametrize(
    ("actors", "generation_tp", "engines"),
    [
        (4, 1, ((0,), (1,), (2,), (3,))),  # one engine per device
        (4, 2, ((0, 1), (2, 3))),  # one engine per replica of two ranks, its TP workers on their devices
        (4, 4, ((0, 1, 2, 3),)),
    ],
)
def test_each_generation_replica_engine_spans_its_ranks_distinct_devices(actors, generation_tp, engines):
    plan = _plan(actors=actors, references=actors // 2, critics=2)
    assert plan.engine_devices(generation_tp) == engines
    used = [bundle for engine in engines for bundle in engine]
    assert sorted(used) == sorted(set(used))  # no device holds two engines' workers
    assert all(plan.workers_on(b)[0] == f"actor {b}" for b in used)
    with pytest.raises(ValueError, match=r"rollout\.tensor_parallel_size=3 must divide the 4 actor ranks"):
        plan.engine_devices(3)
