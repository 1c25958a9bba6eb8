"""The worker-state specs (rldock.runtime.flow.states): each recipe's flow as its specs give it, and a
state added by one spec alone being placed, scheduled, created and launched."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rldock.config.job import JobConfig
from rldock.config.problems import find_problems
from rldock.contract.placement import SeatRequest, plan_placement
from rldock.runtime.driver import attempt as attempt_module
from rldock.runtime.driver.attempt import Attempt, WorkerGroups
from rldock.runtime.flow.catalogue import RECIPES, get_recipe
from rldock.runtime.flow.columns import PROMPT, RESPONSE
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import (
    ACTOR,
    REWARD_MODEL,
    UPDATE,
    StageCall,
    WorkerContext,
    WorkerGroup,
    WorkerState,
    memory_models,
    placement_plan,
    worker_groups,
)
from rldock.runtime.workers.device_worker import seat_processes
from rldock.runtime.workers.phase_schedule import job_schedules, phase_order

P, R = PROMPT, RESPONSE
GRPO_CONSUMES = {
    "rollout": P,
    "actor_inference": P + R,
    "reference": P + R,
    "reward": R + ("prompt_row",),  # each sample's train-file row, put by the driver
    "advantage": ("reward",),
    "update": P + R + ("old_logprobs", "ref_logprobs", "advantage", "policy_version"),
    # the driver's read of each sample's facts, its prompt group's draw number (the prompt ledger's) among them
    "sample_facts": ("score", "response_length", "prompt_draw"),
}
GRPO_PRODUCES = {
    "driver": P + ("prompt_index", "prompt_row", "prompt_draw"),
    "rollout": R + ("response_length", "policy_version"),
    "actor_inference": ("old_logprobs",),
    "reference": ("ref_logprobs",),
    "reward": ("reward", "score"),
    "advantage": ("advantage",),
    "update": (),
    "sample_facts": (),
}
PPO_CONSUMES = {
    **GRPO_CONSUMES,
    "advantage": ("reward", "values", "response_mask"),
    "critic_inference": P + R,
    "critic_update": P + R + ("values", "returns", "value_mask"),
}
PPO_PRODUCES = {
    **GRPO_PRODUCES,
    "advantage": ("advantage", "returns", "value_mask"),
    "critic_inference": ("values",),
    "critic_update": (),
}
REINFORCE_CONSUMES = {**GRPO_CONSUMES, "advantage": ("reward", "response_mask")}
# algorithm -> (consumes, produces), as the dataflow tables gave them before the specs held them
FLOWS = {
    "grpo": (GRPO_CONSUMES, GRPO_PRODUCES),
    "rloo": (GRPO_CONSUMES, GRPO_PRODUCES),
    "gspo": (GRPO_CONSUMES, GRPO_PRODUCES),
    "reinforce_plus_plus": (REINFORCE_CONSUMES, GRPO_PRODUCES),
    "reinforce_plus_plus_baseline": (REINFORCE_CONSUMES, GRPO_PRODUCES),
    "ppo": (PPO_CONSUMES, PPO_PRODUCES),
    "pf_ppo": (
        {**PPO_CONSUMES, "update": PPO_CONSUMES["update"] + ("loss_weight",)},
        {**PPO_PRODUCES, "advantage": ("advantage", "returns", "value_mask", "loss_weight")},
    ),
    "dapo": (
        {**GRPO_CONSUMES, "advantage": ("reward", "score")},
        GRPO_PRODUCES,
    ),
    "dpo": (
        {
            "reference": P + R,
            "preference_update": P + R + ("ref_logprobs",),
            "sample_facts": ("response_length", "prompt_draw"),
        },
        {
            "driver": P + R + ("response_length", "prompt_draw"),
            "reference": ("ref_logprobs",),
            "preference_update": (),
            "sample_facts": (),
        },
    ),
}


def _cfg(name="grpo", *, reward=None, training=None, resources=None, **algorithm) -> JobConfig:
    n = 2 if name == "dpo" else 4
    return JobConfig(
        iterations=1,
        model={"path": "/m"},
        checkpoint={"interval": 1},
        training=training or {},
        resources=resources or {},
        **({"reward": reward} if reward else {}),
        algorithm={
            "name": name,
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": n,
            "max_prompt_length": 4,
            "max_response_length": 4,
            "learning_rate": 1e-3,
            **algorithm,
        },
    )


MODEL_TERM = {"terms": [{"name": "model", "path": "/rm"}]}


def test_every_recipe_is_in_the_table():
    assert set(FLOWS) == set(RECIPES)


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_each_recipes_specs_give_its_flow_in_launch_order(name):
    consumes, produces = FLOWS[name]
    recipe = get_recipe(name)
    assert list(recipe.consumes.items()) == list(consumes.items())  # the dict order is the launch order
    assert recipe.produces == produces


def test_dataflow_is_closed():
    """Every column a state consumes is produced by some earlier state (or the driver)."""
    recipe = get_recipe("grpo")
    produced = {column for columns in recipe.produces.values() for column in columns}
    for state, columns in recipe.consumes.items():
        missing = set(columns) - produced
        assert not missing, f"{state} consumes {missing}, which nothing produces"
    assert set(recipe.consumes) <= set(recipe.produces)


@pytest.mark.parametrize("name", sorted(FLOWS))
def test_the_states_that_train_come_from_the_specs(name):
    recipe = get_recipe(name)
    expected = {
        "ppo": ("update", "critic_update"),
        "pf_ppo": ("update", "critic_update"),
        "dpo": ("preference_update",),
    }.get(name, ("update",))
    assert recipe.training_states == expected
    assert phase_order(recipe)[-len(expected) :] == expected


def test_the_reward_model_is_one_spec_on_a_device_worker_of_its_own():
    recipe = job_recipe(_cfg(reward=MODEL_TERM))
    assert recipe.spec("reward_model") is REWARD_MODEL
    assert REWARD_MODEL.group.worker_class().__name__ == "RewardModelWorker"
    plan = placement_plan(_cfg(reward=MODEL_TERM), recipe.specs)
    assert plan.workers_on(1) == ["reward_model 0"]  # actor 0 and reference 0 fill device 0


def test_lora_moves_the_reference_pass_onto_the_actor_ranks():
    cfg = _cfg(training={"lora": {"rank": 4}})
    recipe = job_recipe(cfg)
    assert recipe.spec("reference").group is ACTOR
    assert "reference" not in worker_groups(recipe.specs)
    assert placement_plan(cfg, recipe.specs).num_devices == 1


@pytest.mark.parametrize("cp", [1, 2])
def test_the_reference_ranks_form_a_group_of_their_own_under_context_parallelism(cp):
    # Under CP each reference CP group runs Ulysses, so its ranks join a process group: a process of
    # their own beside each actor rank's (a process holds one default group); at CP 1 they share it.
    cfg = _cfg(
        training={"strategy": "fsdp", "context_parallel_size": cp},
        kl_coef=0.01,
        resources={"num_nodes": 1, "devices_per_node": 8},
    )
    groups = worker_groups(job_recipe(cfg).specs)
    assert groups["reference"].joins_group(cfg) is (cp > 1)
    plan = placement_plan(cfg, job_recipe(cfg).specs)
    collective = {name for name, group in groups.items() if group.joins_group(cfg)}
    held = [process.seats for process in seat_processes(plan, collective=collective)]
    if cp == 1:
        assert held == [(("actor", 0), ("reference", 0))]
    else:
        assert held == [(("actor", 0),), (("reference", 0),), (("actor", 1),), (("reference", 1),)]
    assert plan.num_devices == cp  # reference rank r beside actor rank r


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "dpo"])
@pytest.mark.parametrize("reward", [None, MODEL_TERM])
@pytest.mark.parametrize("placement", ["colocated", "separate"])
@pytest.mark.parametrize(("tensor_parallel", "context_parallel"), [(1, 1), (2, 1), (1, 2)])
def test_the_config_checks_count_the_devices_the_specs_seat(name, reward, placement, tensor_parallel, context_parallel):
    # The config checks (rldock.config.problems) cannot import the runtime: they count the same groups
    # (with a reference rank per DP rank even where kl_coef 0 drops it, so kl_coef is set here).
    training = {"data_parallel_size": 2, "tensor_parallel_size": tensor_parallel}
    if context_parallel > 1:  # under CP the reference ranks form a group (distinct devices)
        training |= {"strategy": "fsdp", "context_parallel_size": context_parallel}
    cfg = _cfg(
        name,
        reward=reward,
        training=training,
        kl_coef=0.01,
        resources={"placement": placement, "num_nodes": 1, "devices_per_node": 64},
    )
    needed = placement_plan(cfg, job_recipe(cfg).specs).num_devices
    for devices, refused in ((needed, False), (needed - 1, True)):
        tight = cfg.model_copy(update={"resources": cfg.resources.model_copy(update={"devices_per_node": devices})})
        problems = [p for p in find_problems(tight) if "devices" in p.message]
        assert bool(problems) is refused, (devices, problems)


@pytest.mark.parametrize("placement", ["colocated", "separate"])
@pytest.mark.parametrize("data_parallel_size", [1, 2, 3])
def test_ppo_with_a_reward_model_seats_reference_critic_then_reward_model(placement, data_parallel_size):
    # The specs name the reward model's group before the critic's; the seats still follow the
    # contract's SEAT_ORDER, as the config checks' plan does, so the two agree seat by seat.
    cfg = _cfg(
        "ppo",
        reward=MODEL_TERM,
        training={"data_parallel_size": data_parallel_size},
        kl_coef=0.01,
        resources={"placement": placement, "num_nodes": 1, "devices_per_node": 64},
    )
    runtime = placement_plan(cfg, job_recipe(cfg).specs)
    by_hand = plan_placement(
        accelerator=cfg.resources.accelerator_resource,
        num_actor_ranks=data_parallel_size,
        others=[
            SeatRequest("reward_model", 1),
            SeatRequest("critic", data_parallel_size, distinct=True),
            SeatRequest("reference", data_parallel_size),
        ],
        mode=placement,
    )
    assert runtime == by_hand
    assert list(runtime.seats) == ["actor", "reference", "critic", "reward_model"]


def test_an_unknown_state_is_a_key_error_naming_it_and_the_recipe_states():
    with pytest.raises(KeyError, match="no state 'critic_update'.*'update'"):
        job_recipe(_cfg("grpo")).spec("critic_update")


def test_the_planner_sizes_the_groups_the_specs_name():
    assert memory_models(job_recipe(_cfg("ppo")).specs) == {"actor", "critic"}
    assert memory_models(job_recipe(_cfg("grpo", reward=MODEL_TERM)).specs) == {"actor"}


def test_two_specs_naming_one_group_differently_are_refused():
    other = replace(ACTOR, ranks="one")
    with pytest.raises(ValueError, match="names worker group 'actor' differently"):
        worker_groups((UPDATE, replace(UPDATE, name="second", group=other)))


# --- a state added by one spec ---------------------------------------------------------------------


class ToyWorker:
    """A worker scoring each response (the test double of a new worker class)."""

    def __init__(self, *, cfg, banks, tag):
        self.cfg, self.banks, self.tag = cfg, banks, tag


def _toy_arguments(ctx: WorkerContext, rank: int, world_size: int) -> dict:
    return {"cfg": ctx.cfg, "banks": ctx.banks, "tag": f"toy {rank}/{world_size}"}


TOY = WorkerState(
    "toy_score",
    WorkerGroup("toy", f"{__name__}:ToyWorker", _toy_arguments),
    method="score",
    consumes=PROMPT + RESPONSE,
    produces=("toy_score",),
)


def _with_toy(recipe):
    """`recipe` with TOY after its rollout, and the update reading its column."""
    specs = []
    for spec in recipe.specs:
        if spec.name == "update":
            spec = replace(spec, consumes=spec.consumes + TOY.produces)
        specs.append(spec)
        if spec.name == "rollout":
            specs.append(TOY)
    return replace(recipe, specs=tuple(specs))


def test_a_state_added_by_one_spec_is_in_the_flow_placed_and_scheduled():
    cfg = _cfg(kl_coef=0.0)  # no reference: the toy worker takes the actor device's other half
    recipe = _with_toy(job_recipe(cfg))
    assert recipe.consumes["toy_score"] == PROMPT + RESPONSE and "toy_score" in recipe.launched_states
    plan = placement_plan(cfg, recipe.specs)
    assert plan.workers_on(0) == ["actor 0", "toy 0"] and plan.num_devices == 1
    order = phase_order(recipe)
    assert order.index("rollout") < order.index("toy_score") < order.index("update")
    [turns] = job_schedules(plan, recipe).values()
    assert [(turn.phase, turn.workers) for turn in turns] == [
        ("rollout", ("actor 0",)),
        ("toy_score", ("toy 0",)),
        ("update", ("actor 0",)),
    ]


class _Call:
    def __init__(self, log: list, handle: str, method: str):
        self.log, self.handle, self.method = log, handle, method

    def remote(self, *args, **kwargs):
        self.log.append((self.handle, self.method, args, kwargs))
        return f"{self.handle}.{self.method}"


class _Handle:
    """A Ray actor handle double: every method's `.remote` records the call."""

    def __init__(self, log: list, name: str):
        self._log, self._name = log, name

    def __getattr__(self, method: str) -> _Call:
        return _Call(self._log, self._name, method)


def test_an_attempt_creates_and_launches_a_state_added_by_one_spec(monkeypatch):
    cfg = _cfg(kl_coef=0.0)
    recipe = _with_toy(job_recipe(cfg))
    inputs = type("Inputs", (), {"recipe": recipe})()  # the job inputs an attempt's workers read
    attempt = Attempt(cfg, inputs, output_dir="/out", resume_from=None)  # its workers only: no data, model or Ray
    attempt.plan, attempt.placement = placement_plan(cfg, recipe.specs), "group"
    context = WorkerContext(
        cfg=cfg,
        recipe=recipe,
        banks="banks",
        policy_dir="/policy",
        reference_dir="/ref",
        adapter_dir=None,
        policy_version=0,
    )
    created, calls = [], []

    def start(cls, *, seat=None):
        class Starter:
            def remote(self, *args, **kwargs):
                created.append((cls.__name__, seat, args or kwargs))
                return _Handle(calls, f"{cls.__name__}#{len(created) - 1}")

        return Starter()

    monkeypatch.setattr(attempt_module.cluster, "seated", lambda cls, *, group, plan, seat: start(cls, seat=seat))
    monkeypatch.setattr(
        attempt_module.cluster,
        "seated_together",
        lambda cls, *, group, plan, seats, max_concurrency: start(cls, seat=tuple(seats)),
    )
    monkeypatch.setattr(attempt_module.cluster, "remote", lambda cls, *, num_cpus: start(cls))
    monkeypatch.setattr(attempt_module.ray, "get", lambda refs: refs)
    monkeypatch.setattr(attempt_module, "engine_environments", lambda seats, generation_tp: {})
    monkeypatch.setattr(attempt_module, "hand_out_turns", lambda *args: None)

    workers = attempt.create_workers(context)
    # The toy seat shares device 0 with actor rank 0: one device worker holds both (device_worker.py).
    [device] = [entry for entry in created if entry[0] == "DeviceWorker"]
    _, seats, (roles,) = device
    assert seats == (attempt.plan.group("actor")[0], attempt.plan.group("toy")[0])
    toy = roles[1]
    assert (toy.name, toy.cls, toy.arguments()) == (
        "toy 0",
        ToyWorker,
        {"cfg": cfg, "banks": "banks", "tag": "toy 0/1"},
    )
    assert set(workers.ranks) == {"actor", "toy", "reward"}  # the reward computes the advantage (fused)
    calls.clear()
    call = StageCall(7, sampling_round=2, round_tokens=16)
    futures = workers.launch(call, [recipe.spec("toy_score")])["toy_score"]
    assert len(futures) == 1 and calls == [
        (f"DeviceWorker#{created.index(device)}", "call", ("toy 0", 0, "score", call), {})
    ]
    calls.clear()
    workers.launch(call, [recipe.spec("rollout")])  # every state gets the same one call
    [(_, _, (role, _, method, *arguments), _)] = calls
    assert (role, method, tuple(arguments)) == ("actor 0", "generate", (call,))
    assert recipe.training_states == ("update",)
    assert "toy_score" in recipe.launched_states


def test_worker_groups_run_a_state_on_its_ranks_or_its_engines():
    log: list = []
    actors = [_Handle(log, f"actor {i}") for i in range(4)]
    workers = WorkerGroups({"actor": actors, "toy": [_Handle(log, "toy 0")]}, generation_tp=2)
    assert workers.runners(get_recipe("grpo").spec("rollout")) == actors[::2]
    assert workers.runners(get_recipe("grpo").spec("update")) == actors
    assert len(workers.all()) == 5 and workers.references == []
