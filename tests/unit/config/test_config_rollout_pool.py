"""Config rules of a rollout pool (rollout.pool): what a pool engine does not do yet is refused, each with
its reason and the field to change; a local Ray gets the pool's devices beside the trainer's."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config
from rldock.config.rollout_pool import pool_devices

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def demo_data() -> dict:
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["rollout"] = {"pool": {"replicas": 2}}
    return data


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return [str(problem) for problem in caught.value.problems]


def test_a_pool_beside_the_actor_ranks_engines_by_default_and_its_devices_apart(demo_data):
    cfg = parse_job_config(demo_data)
    assert cfg.rollout.pool is not None and cfg.rollout.pool.actors_generate
    assert pool_devices(cfg) == 2 and cfg.num_devices == 8  # the trainer's devices are not the pool's
    del demo_data["rollout"]
    assert pool_devices(parse_job_config(demo_data)) == 0


def test_a_pool_needs_at_least_one_engine(demo_data):
    demo_data["rollout"]["pool"]["replicas"] = 0
    assert any(p.startswith("rollout.pool.replicas") for p in problems(demo_data))


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"rollout": {"tensor_parallel_size": 2}}, "a pool engine holds one device"),
        ({"training": {"tensor_parallel_size": 2, "data_parallel_size": 1}}, "keeps no copy for a pool's engines"),
        ({"training": {"resharding": "allgather_swap"}}, "keeps no copy for a pool's engines"),
        (
            {
                "rollout": {"partial_rollout": "resume", "max_tokens_per_round": 2},
                "training": {"data_parallel_size": 2, "mode": "async"},
                "dock": {"max_staleness": 1},
            },
            "a cut generation goes on in the engine that cut it",
        ),
    ],
)
def test_what_a_pool_engine_does_not_do_yet_is_refused_with_its_reason(demo_data, change, reason):
    for section, fields in change.items():
        demo_data.setdefault(section, {}).update(fields)
    found = problems(demo_data)
    assert any(p.startswith("rollout.pool:") and reason in p for p in found), found


def test_dpo_has_nothing_for_a_pool_to_generate(demo_data):
    demo_data["algorithm"]["name"] = "dpo"
    assert any("rollout.pool:" in p and "trains on given responses" in p for p in problems(demo_data))
