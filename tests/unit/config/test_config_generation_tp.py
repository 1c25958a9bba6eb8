"""Config rules for generation tensor parallelism (rollout.tensor_parallel_size), independent of
training.tensor_parallel_size: replicas of consecutive actor ranks, one engine each."""

import json
from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, load_job_config, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def demo_data() -> dict:
    return yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())  # DP 2, 8 devices per node, G 16


def problems(data: dict) -> list:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return caught.value.problems


def test_default_is_one_engine_per_actor_rank(demo_data):
    assert parse_job_config(demo_data).rollout.tensor_parallel_size == 1


@pytest.mark.parametrize("dp, tp, gen_tp", [(2, 1, 2), (2, 2, 1), (2, 2, 4), (4, 1, 2), (1, 4, 2)])
def test_generation_tp_independent_of_training_tp(demo_data, dp, tp, gen_tp):
    demo_data["training"].update(data_parallel_size=dp, tensor_parallel_size=tp)
    demo_data["rollout"] = {"tensor_parallel_size": gen_tp}
    cfg = parse_job_config(demo_data)
    assert (cfg.training.tensor_parallel_size, cfg.rollout.tensor_parallel_size) == (tp, gen_tp)


def test_generation_tp_must_divide_the_actor_ranks(demo_data):
    demo_data["training"].update(data_parallel_size=2, tensor_parallel_size=1)
    demo_data["rollout"] = {"tensor_parallel_size": 4}
    (problem,) = problems(demo_data)
    assert problem.path == "rollout.tensor_parallel_size" and "= 2 actor ranks" in problem.message


def test_every_generation_replica_gets_whole_prompt_groups(demo_data):
    demo_data["algorithm"]["num_prompts_per_iteration"] = 6  # 6 groups over 8 ranks / 2 = 4 replicas
    demo_data["algorithm"]["num_responses_per_prompt"] = 8
    demo_data["training"].update(data_parallel_size=8, tensor_parallel_size=1)
    demo_data["rollout"] = {"tensor_parallel_size": 2}
    (problem,) = problems(demo_data)
    assert problem.path == "rollout.tensor_parallel_size" and "must divide by 4" in problem.message


def test_one_engine_stays_on_one_node(demo_data):
    demo_data["resources"].update(num_nodes=2, devices_per_node=2)
    demo_data["training"].update(data_parallel_size=4, tensor_parallel_size=1)
    demo_data["rollout"] = {"tensor_parallel_size": 4}
    assert [p.path for p in problems(demo_data)] == ["rollout.tensor_parallel_size"]


def test_dpo_has_no_engine_to_split(demo_data):
    demo_data["algorithm"].update(name="dpo", num_responses_per_prompt=2)
    demo_data["rollout"] = {"tensor_parallel_size": 2}
    assert [p.path for p in problems(demo_data)] == ["rollout.tensor_parallel_size"]


def test_generation_tp_must_split_the_models_heads(tmp_path, demo_data):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512})
    )
    demo_data["model"] = {"path": str(model)}
    demo_data["training"].update(data_parallel_size=4, tensor_parallel_size=1)
    demo_data["rollout"] = {"tensor_parallel_size": 4}
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    with pytest.raises(ConfigError) as caught:
        load_job_config(config_file)
    (problem,) = caught.value.problems  # no trainer plan needed for gpt2: vLLM splits it itself
    assert problem.path == "rollout.tensor_parallel_size" and "num_key_value_heads (2)" in problem.message
    demo_data["rollout"] = {"tensor_parallel_size": 2}
    config_file.write_text(yaml.safe_dump(demo_data))
    assert load_job_config(config_file).rollout.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("section", "setting"),
    [
        ("resources", {"phase_schedule": "serial"}),
        ("rollout", {"sleep_level": 2}),  # the sleep cycle runs on accelerators only: not run at generation TP > 1
    ],
)
def test_combinations_not_run_with_an_engine_over_several_ranks_are_refused(demo_data, section, setting):
    demo_data["training"].update(data_parallel_size=2, tensor_parallel_size=1)
    demo_data.setdefault("rollout", {})["tensor_parallel_size"] = 2
    demo_data.setdefault(section, {}).update(setting)
    assert "rollout.tensor_parallel_size" in [p.path for p in problems(demo_data)]


# Run at generation TP 2 by tests/integration/test_async_job.py (DDP and FSDP x EP, run ahead) and
# test_lora_job.py (the merged adapters pushed into one engine for two DDP ranks).
@pytest.mark.parametrize(
    "changes",
    [
        {"training": {"mode": "async"}, "dock": {"max_staleness": 1}},
        {
            "training": {"mode": "async"},
            "dock": {"max_staleness": 1},
            "rollout": {"partial_rollout": "resume", "max_tokens_per_round": 3},
        },
        {
            "training": {"mode": "async", "strategy": "fsdp", "resharding": "allgather_swap"},
            "dock": {"max_staleness": 1},
        },
        {"training": {"lora": {"rank": 4}}},
    ],
)
def test_async_partial_rollout_and_lora_take_an_engine_over_several_ranks(demo_data, changes):
    demo_data["training"].update(data_parallel_size=2, tensor_parallel_size=1)
    demo_data.setdefault("rollout", {})["tensor_parallel_size"] = 2
    for section, fields in changes.items():
        demo_data.setdefault(section, {}).update(fields)
    assert parse_job_config(demo_data).rollout.tensor_parallel_size == 2


@pytest.mark.parametrize("device", ["npu", "cuda"])
def test_accelerators_take_generation_tp_where_the_job_runs(tmp_path, demo_data, device):
    # The trainer hands each replica's devices to its engine rank (runtime/engines/replica_devices.py).
    demo_data["training"].update(data_parallel_size=2, tensor_parallel_size=1)
    demo_data["rollout"] = {"tensor_parallel_size": 2}
    demo_data["resources"]["device"] = device
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    assert load_job_config(config_file).rollout.tensor_parallel_size == 2  # `rldock validate` / `rldock train`
