"""The serial phase schedule: one topological order of each recipe, restricted per shared device,
and the turn keeper that grants it (run as a plain asyncio object; the Ray actor is the same class)."""

from __future__ import annotations

import asyncio

import pytest

from rldock.contract.placement import SeatRequest, plan_placement
from rldock.runtime.flow.catalogue import RECIPES, get_recipe
from rldock.runtime.flow.job_recipe import with_reference_on_actor, with_reward_model, without_states
from rldock.runtime.workers.phase_keeper import TurnKeeper
from rldock.runtime.workers.phase_schedule import (
    Turn,
    device_schedules,
    job_schedules,
    phase_order,
    resolve_phase_schedule,
    state_runners,
)


def plan(*, actors: int, references: int, critics: int = 0, reward_model: bool = False, mode: str = "colocated"):
    others = [
        SeatRequest("reference", references),
        SeatRequest("critic", critics, distinct=True),
        SeatRequest("reward_model", int(reward_model)),
    ]
    return plan_placement(accelerator="NPU", num_actor_ranks=actors, others=others, mode=mode)


def phases(schedule: tuple[Turn, ...]) -> list[str]:
    return [turn.phase for turn in schedule]


@pytest.mark.parametrize("name", sorted(RECIPES))
@pytest.mark.parametrize("reward_model", [False, True])
def test_every_recipe_order_is_topological_and_keeps_the_launch_order_per_worker(name, reward_model):
    recipe = with_reward_model(get_recipe(name)) if reward_model else get_recipe(name)
    order = phase_order(recipe)
    assert sorted(order) == sorted(recipe.launched_states)
    position = {state: i for i, state in enumerate(order)}
    for state in order:
        for producer, columns in recipe.produces.items():
            if producer in position and producer != state and set(columns) & set(recipe.consumes[state]):
                assert position[producer] < position[state], (state, producer)
    # each Ray actor runs its calls in submission order, which the trainer gives by launch order
    # (updates last): a worker's phases must keep that order or its queue would block its own turn
    launched = recipe.launched_states
    submitted = [s for s in launched if "update" not in s] + [s for s in launched if "update" in s]
    for group_states in (
        ("rollout", "actor_inference", "reference", "update", "preference_update"),
        ("critic_inference", "critic_update"),
    ):
        mine = [s for s in order if s in group_states]
        assert mine == [s for s in submitted if s in group_states]


def test_ppo_moves_the_advantage_after_the_critic_values_it_reads():
    order = phase_order(get_recipe("ppo"))
    assert order.index("critic_inference") < order.index("advantage") < order.index("update")
    assert order[-2:] == ("update", "critic_update")


def test_grpo_dp2_colocated_each_device_runs_actor_then_reference_then_update():
    schedules = job_schedules(plan(actors=2, references=2), get_recipe("grpo"))
    assert set(schedules) == {0, 1}
    for device in (0, 1):
        assert schedules[device] == (
            Turn("rollout", (f"actor {device}",)),
            Turn("actor_inference", (f"actor {device}",)),
            Turn("reference", (f"reference {device}",)),
            Turn("update", (f"actor {device}",)),
        )


def test_unscheduled_states_and_dropped_passes_stay_out():
    recipe = without_states(get_recipe("grpo"), {"actor_inference"})  # recompute_old_logprobs off
    schedules = job_schedules(plan(actors=1, references=1), recipe)
    assert phases(schedules[0]) == ["rollout", "reference", "update"]  # reward, advantage hold no device


def test_ppo_tp2_dp2_puts_each_critic_rank_beside_an_actor_rank():
    layout = plan(actors=4, references=2, critics=2)
    schedules = job_schedules(layout, get_recipe("ppo"))
    assert layout.workers_on(3) == ["actor 3", "critic 1"]
    for device in (2, 3):
        assert phases(schedules[device]) == [
            "rollout",
            "actor_inference",
            "critic_inference",
            "update",
            "critic_update",
        ]
    assert schedules[3][2] == Turn("critic_inference", ("critic 1",))
    assert phases(schedules[1]) == ["rollout", "actor_inference", "reference", "update"]


def test_a_device_with_one_worker_is_not_scheduled():
    layout = plan(actors=2, references=1)  # TP 2 x DP 1: one reference rank, beside actor 0
    assert layout.workers_on(1) == ["actor 1"] and set(job_schedules(layout, get_recipe("grpo"))) == {0}


def test_only_a_generation_replicas_first_rank_takes_a_rollout_turn():
    schedules = job_schedules(plan(actors=2, references=2), get_recipe("grpo"), generation_tp=2)
    assert phases(schedules[0]) == ["rollout", "actor_inference", "reference", "update"]
    assert phases(schedules[1]) == ["actor_inference", "reference", "update"]  # actor 1 starts no engine


def test_critic_and_reward_model_sharing_a_device_take_turns_by_the_dataflow():
    layout = plan(actors=1, references=1, critics=1, reward_model=True)
    schedules = job_schedules(layout, with_reward_model(get_recipe("ppo")))
    assert schedules[1] == (
        Turn("reward_model", ("reward_model 0",)),
        Turn("critic_inference", ("critic 0",)),
        Turn("critic_update", ("critic 0",)),
    )


def test_separate_placement_and_lora_share_no_device():
    assert job_schedules(plan(actors=2, references=2, critics=2, mode="separate"), get_recipe("ppo")) == {}
    lora = plan(actors=2, references=0)  # LoRA: the actor ranks run the reference pass themselves
    recipe = with_reference_on_actor(get_recipe("grpo"))  # as job_recipe makes it under LoRA
    assert state_runners(lora, recipe)["reference"] == ("actor 0", "actor 1")
    assert job_schedules(lora, recipe) == {}


def test_workers_sharing_one_phase_on_a_device_share_its_turn():
    layout = plan(actors=1, references=1)
    runners = {"rollout": ("actor 0",), "reference": ("actor 0", "reference 0")}
    assert device_schedules(layout, ("rollout", "reference"), runners) == {
        0: (Turn("rollout", ("actor 0",)), Turn("reference", ("actor 0", "reference 0")))
    }


@pytest.mark.parametrize(
    "setting, kind, placement, mode, expected",
    [
        ("auto", "npu", "colocated", "sync", "serial"),
        ("auto", "cuda", "colocated", "sync", "serial"),
        ("auto", "cpu", "colocated", "sync", "overlap"),
        ("auto", "npu", "separate", "sync", "overlap"),
        ("auto", "npu", "colocated", "async", "overlap"),
        ("serial", "cpu", "colocated", "sync", "serial"),
        ("overlap", "npu", "colocated", "sync", "overlap"),
    ],
)
def test_auto_is_serial_only_on_accelerators_with_colocated_sync_jobs(setting, kind, placement, mode, expected):
    assert resolve_phase_schedule(setting, device_kind=kind, placement=placement, mode=mode) == expected


def test_keeper_grants_a_device_its_phases_in_order_and_shared_phases_together():
    schedules = {
        0: (Turn("rollout", ("actor 0",)), Turn("reference", ("actor 0", "reference 0")), Turn("update", ("actor 0",)))
    }

    async def scenario() -> list[str]:
        keeper, events = TurnKeeper(schedules), []

        async def phase(worker: str, name: str) -> None:
            await keeper.wait_turn(0, 1, name)
            events.append(f"start {name} {worker}")
            await asyncio.sleep(0)  # let any wrongly granted phase start now
            events.append(f"end {name} {worker}")
            await keeper.done(0, 1, name, worker, 0.0, 1.0)

        # asked in the worst order: the last phase first
        await asyncio.gather(
            phase("actor 0", "update"),
            phase("reference 0", "reference"),
            phase("actor 0", "reference"),
            phase("actor 0", "rollout"),
        )
        return events

    events = asyncio.run(scenario())
    assert events[:2] == ["start rollout actor 0", "end rollout actor 0"]
    assert sorted(events[2:6]) == sorted(
        ["start reference reference 0", "start reference actor 0", "end reference reference 0", "end reference actor 0"]
    )
    assert events[2].startswith("start") and events[3].startswith("start")  # the shared phase runs together
    assert events[6:] == ["start update actor 0", "end update actor 0"]


def test_keeper_skips_phases_a_resumed_iteration_does_not_rerun_and_reports_the_timeline():
    schedules = {0: (Turn("rollout", ("actor 0",)), Turn("update", ("actor 0",)))}

    async def scenario():
        keeper = TurnKeeper(schedules)
        await keeper.done(0, 1, "rollout", "actor 0", 10.0, 11.0)
        await keeper.wait_turn(0, 1, "update")
        await keeper.done(0, 1, "update", "actor 0", 11.5, 12.0)
        first = await keeper.timeline(1)
        await keeper.skip(2, ["rollout"])
        await asyncio.wait_for(keeper.wait_turn(0, 2, "update"), timeout=5)
        return first, await keeper.timeline(1)

    first, stale = asyncio.run(scenario())
    assert first == [
        {"device": 0, "phase": "rollout", "worker": "actor 0", "start": 0.0, "end": 1.0},
        {"device": 0, "phase": "update", "worker": "actor 0", "start": 1.5, "end": 2.0},
    ]
    assert stale == []  # iteration 2 started: only its timeline is kept


def test_keeper_refuses_a_phase_outside_the_device_schedule():
    keeper = TurnKeeper({0: (Turn("rollout", ("actor 0",)),)})
    with pytest.raises(ValueError, match="not in device 0's schedule"):
        asyncio.run(keeper.wait_turn(0, 1, "critic_update"))
