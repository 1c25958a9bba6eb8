"""The job layout: actor ranks, generation replicas, device groups and seats from the parallel sizes,
the devices and the placement mode alone."""

from __future__ import annotations

import pytest

from rldock.contract.layout import DeviceGroup, JobLayout
from rldock.contract.placement import SEAT_ORDER

REFERENCE = DeviceGroup("reference", "stage_sequence_ranks")
CRITIC = DeviceGroup("critic", "sequence_ranks", distinct=True)
REWARD_MODEL = DeviceGroup("reward_model")


@pytest.mark.parametrize(
    ("dp", "tp", "generation_tp", "actor_ranks", "replicas", "engine_ranks"),
    [
        (1, 1, 1, 1, 1, (0,)),
        (4, 1, 1, 4, 4, (0, 1, 2, 3)),
        (2, 2, 1, 4, 4, (0, 1, 2, 3)),  # training TP 2 x DP 2, an engine per rank
        (2, 2, 2, 4, 2, (0, 2)),  # generation replicas of 2 consecutive ranks
        (1, 4, 4, 4, 1, (0,)),
        (3, 2, 3, 6, 2, (0, 3)),
    ],
)
def test_ranks_and_generation_replicas(dp, tp, generation_tp, actor_ranks, replicas, engine_ranks):
    layout = JobLayout(dp=dp, tp=tp, generation_tp=generation_tp)
    assert layout.num_actor_ranks == actor_ranks
    assert layout.num_generation_replicas == replicas
    assert layout.engine_ranks == engine_ranks
    assert (layout.num_ranks("actor_ranks"), layout.num_ranks("sequence_ranks"), layout.num_ranks("one")) == (
        actor_ranks,
        dp,
        1,
    )


@pytest.mark.parametrize(
    ("dp", "cp", "tp", "actor_ranks", "sequence_ranks"), [(2, 2, 1, 4, 4), (1, 4, 1, 4, 4), (2, 2, 2, 8, 4)]
)
def test_context_parallel_ranks_multiply_the_actor_and_the_reference_ranks(dp, cp, tp, actor_ranks, sequence_ranks):
    layout = JobLayout(dp=dp, cp=cp, tp=tp)
    assert (layout.num_actor_ranks, layout.num_ranks("sequence_ranks"), layout.num_sequence_ranks) == (
        actor_ranks,
        sequence_ranks,
        sequence_ranks,
    )


@pytest.mark.parametrize(
    ("pp", "dp", "cp", "tp", "stage_sequence_ranks"), [(2, 2, 1, 1, 4), (2, 1, 2, 2, 4), (4, 1, 1, 1, 4)]
)
def test_the_reference_runs_a_rank_per_sequence_rank_of_each_stage(pp, dp, cp, tp, stage_sequence_ranks):
    layout = JobLayout(dp=dp, cp=cp, tp=tp, pp=pp)
    assert layout.num_ranks("stage_sequence_ranks") == layout.num_stage_sequence_ranks == stage_sequence_ranks
    assert layout.num_sequence_ranks == dp * cp  # the critic's, and what FSDP shards over within a stage


def test_a_generation_tp_that_does_not_divide_the_actor_ranks_is_named():
    layout = JobLayout(dp=2, tp=2, generation_tp=3)
    assert not layout.generation_divides
    with pytest.raises(ValueError, match=r"rollout\.tensor_parallel_size=3 must divide the 4 actor ranks"):
        _ = layout.num_generation_replicas


# (placement, dp, tp, groups) -> devices needed, worker processes on devices, the seats on device 0
SEATING = [
    ("colocated", 2, 1, (REFERENCE,), 2, 4, ["actor 0", "reference 0"]),
    ("separate", 2, 1, (REFERENCE,), 4, 4, ["actor 0"]),
    ("colocated", 1, 1, (), 1, 1, ["actor 0"]),  # LoRA: the actor ranks run the reference pass
    # PPO, DP 2: the critic ranks form a DDP group, so each opens a device of its own
    ("colocated", 2, 1, (REFERENCE, CRITIC), 4, 6, ["actor 0", "reference 0"]),
    ("separate", 2, 1, (REFERENCE, CRITIC), 6, 6, ["actor 0"]),
    # TP 2 x DP 2: the critic ranks fill the halves the references left on the actor devices
    ("colocated", 2, 2, (REFERENCE, CRITIC), 4, 8, ["actor 0", "reference 0"]),
    # the reward model takes a half a critic left, whatever order the groups are named in
    ("colocated", 2, 1, (REWARD_MODEL, CRITIC, REFERENCE), 4, 7, ["actor 0", "reference 0"]),
    ("separate", 1, 1, (REFERENCE, REWARD_MODEL), 3, 3, ["actor 0"]),
]


@pytest.mark.parametrize(("placement", "dp", "tp", "groups", "needed", "workers", "device_0"), SEATING)
def test_devices_and_seats_follow_the_placement_and_the_groups(placement, dp, tp, groups, needed, workers, device_0):
    layout = JobLayout(dp=dp, tp=tp, placement=placement, groups=groups, num_nodes=2, devices_per_node=4)
    assert layout.num_devices == 8
    assert layout.num_devices_needed == needed
    assert layout.num_device_workers == workers == sum(len(seats) for seats in layout.plan.seats.values())
    assert layout.seats_on(0) == device_0
    assert list(layout.plan.seats)[1:] == [name for name in SEAT_ORDER if name in {g.name for g in groups}]


def test_the_seat_order_on_a_shared_device_is_reference_critic_reward_model():
    layout = JobLayout(dp=1, groups=(REWARD_MODEL, CRITIC, REFERENCE))
    assert [layout.seats_on(device) for device in range(layout.num_devices_needed)] == [
        ["actor 0", "reference 0"],
        ["critic 0", "reward_model 0"],
    ]


def test_group_ranks_counts_a_named_group_and_zero_for_one_the_job_does_not_run():
    layout = JobLayout(dp=3, tp=2, groups=(REFERENCE, CRITIC, REWARD_MODEL))
    assert [layout.group_ranks(name) for name in ("reference", "critic", "reward_model", "toy")] == [3, 3, 1, 0]
    assert [request.count for request in layout.seat_requests()] == [3, 3, 1]


@pytest.mark.parametrize(("dp", "needed"), [(1, 2), (4, 8), (100, 200)])
def test_a_data_parallel_override_keeps_everything_else(dp, needed):
    # the planner plans one DP rank of a job at any DP size
    layout = JobLayout(dp=8, tp=2, generation_tp=2, groups=(REFERENCE, CRITIC), devices_per_node=16)
    other = layout.with_data_parallel_size(dp)
    assert (other.dp, other.tp, other.generation_tp, other.groups) == (dp, 2, 2, layout.groups)
    assert other.num_actor_ranks == 2 * dp and other.num_devices_needed == needed
    assert layout.num_actor_ranks == 16  # the original is unchanged


@pytest.mark.parametrize("field", ["dp", "tp", "cp", "ep", "generation_tp", "num_nodes", "devices_per_node"])
def test_a_size_below_one_is_refused_naming_it(field):
    with pytest.raises(ValueError, match=rf"{field}=0"):
        JobLayout(**{"dp": 1, field: 0})


@pytest.mark.parametrize(
    ("dp", "cp", "ep", "divides", "expert_dp"),
    [
        (4, 1, 1, True, 4),
        (4, 1, 2, True, 2),
        (4, 1, 4, True, 1),
        (4, 1, 3, False, None),
        (2, 2, 4, True, 1),  # an EP group spans both CP groups
        (1, 4, 2, True, 2),  # inside the one CP group
        (2, 2, 3, False, None),
    ],
)
def test_expert_parallel_groups_are_carved_out_of_the_sequence_ranks(dp, cp, ep, divides, expert_dp):
    layout = JobLayout(dp=dp, cp=cp, ep=ep)
    assert layout.experts_divide is divides and layout.num_actor_ranks == dp * cp  # EP adds no ranks
    if divides:
        assert layout.expert_data_parallel == expert_dp
    else:
        with pytest.raises(ValueError, match="expert_parallel_size=3 must divide"):
            _ = layout.expert_data_parallel
