"""Config checks of placement, LoRA and the engine's sleep level: the devices the placement plan
needs must exist, and LoRA and sleep level 2 need replicated (DDP) actor ranks."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

BASE = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml").read_text())


def _parse(**sections):
    data = {**BASE, **{name: {**BASE.get(name, {}), **value} for name, value in sections.items()}}
    return parse_job_config(data)


def _problems(**sections):
    with pytest.raises(ConfigError) as caught:
        _parse(**sections)
    return caught.value.problems


def test_separate_placement_counts_a_device_per_reference_rank():
    two = {"devices_per_node": 2}
    _parse(resources=two)  # colocated: 2 actor ranks, their references beside them
    (problem,) = _problems(resources={**two, "placement": "separate"})
    assert problem.path == "resources.devices_per_node"
    assert "with separate placement the job needs 4 devices but resources give 2" in problem.message
    # LoRA: the actors run the reference pass themselves, so no reference ranks need devices
    _parse(resources={**two, "placement": "separate"}, training={"lora": {"rank": 4}})


def test_tensor_parallel_actor_devices_have_room_for_the_critic():
    # DP 1 x TP 2 on 2 devices: the reference and the critic take the two free halves.
    _parse(
        resources={"devices_per_node": 2},
        algorithm={"name": "ppo"},
        training={"data_parallel_size": 1, "tensor_parallel_size": 2},
    )


def test_the_critic_takes_half_a_device_per_data_parallel_rank():
    # DP 2 colocated: two actor devices with their references, then one device per critic rank (a
    # DDP group: never two ranks on one device).
    _parse(resources={"devices_per_node": 4}, algorithm={"name": "ppo"}, training={"data_parallel_size": 2})
    (problem,) = _problems(
        resources={"devices_per_node": 3}, algorithm={"name": "ppo"}, training={"data_parallel_size": 2}
    )
    assert "needs 4 devices but resources give 3" in problem.message
    (problem,) = _problems(
        resources={"devices_per_node": 3, "placement": "separate"},
        algorithm={"name": "ppo"},
        training={"data_parallel_size": 2},
    )
    assert problem.message.startswith("algorithm.name ppo runs 2 critic rank(s) (one per data-parallel rank)")
    assert "needs 6 devices but resources give 3" in problem.message


@pytest.mark.parametrize("training", [{"tensor_parallel_size": 2}, {"resharding": "allgather_swap"}])
def test_lora_and_sleep_level_2_need_replicated_actor_ranks(training):
    problems = _problems(training={**training, "lora": {"rank": 4}}, rollout={"sleep_level": 2})
    assert {p.path for p in problems} == {"training.lora", "rollout.sleep_level"}


def test_lora_fields_are_bounded():
    (problem,) = _problems(training={"lora": {"rank": 0}})
    assert problem.path == "training.lora.rank"
    (problem,) = _problems(training={"lora": {"target_modules": []}})
    assert problem.path == "training.lora.target_modules"
