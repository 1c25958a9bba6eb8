"""Config rules for tensor parallelism and resharding (training.tensor_parallel_size / resharding)."""

import json
from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, load_job_config, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def demo_data() -> dict:
    return yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())


def problems(data: dict) -> list:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return caught.value.problems


def test_defaults_keep_the_ddp_path(demo_data):
    training = parse_job_config(demo_data).training
    assert (training.tensor_parallel_size, training.resharding) == (1, "naive")


def test_tp2_allgather_swap_is_valid(demo_data):
    demo_data["training"].update(data_parallel_size=4, tensor_parallel_size=2, resharding="allgather_swap")
    training = parse_job_config(demo_data).training
    assert (training.tensor_parallel_size, training.resharding) == (2, "allgather_swap")


@pytest.mark.parametrize("value", [0, 65])
def test_tp_outside_its_bounds_is_named(demo_data, value):
    demo_data["training"]["tensor_parallel_size"] = value
    assert [p.path for p in problems(demo_data)] == ["training.tensor_parallel_size"]


def test_actor_ranks_must_fit_the_devices(demo_data):
    demo_data["training"].update(data_parallel_size=8, tensor_parallel_size=2)  # 16 ranks, 8 devices
    (problem,) = problems(demo_data)
    assert problem.path == "training.tensor_parallel_size"
    assert "16 actor ranks need 16 devices" in problem.message and "= 8" in problem.message


def test_every_generation_replica_gets_whole_prompt_groups(demo_data):
    demo_data["algorithm"]["num_prompts_per_iteration"] = 6  # 6 groups over DP 2 x TP 2 = 4 replicas
    demo_data["training"].update(data_parallel_size=2, tensor_parallel_size=2)
    (problem,) = problems(demo_data)
    assert problem.path == "training.tensor_parallel_size" and "divide by" in problem.message


@pytest.mark.parametrize("field, value", [("tensor_parallel_size", 2), ("resharding", "allgather_swap")])
def test_dpo_refuses_tp_and_resharding(demo_data, field, value):
    demo_data["algorithm"].update(name="dpo", num_responses_per_prompt=2)
    demo_data["training"][field] = value
    assert [p.path for p in problems(demo_data)] == [f"training.{field}"]


def test_tp_must_split_the_models_heads(tmp_path, demo_data):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 1, "intermediate_size": 512}
        )
    )
    demo_data["model"] = {"path": str(model)}
    demo_data["training"].update(data_parallel_size=1, tensor_parallel_size=2)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    with pytest.raises(ConfigError) as caught:
        load_job_config(config_file)
    (problem,) = caught.value.problems
    assert problem.path == "training.tensor_parallel_size" and "num_key_value_heads (1)" in problem.message
    demo_data["training"]["tensor_parallel_size"] = 1  # TP 1 splits nothing
    config_file.write_text(yaml.safe_dump(demo_data))
    assert load_job_config(config_file).training.tensor_parallel_size == 1


@pytest.mark.parametrize("model_type, accepted", [("llama", True), ("qwen3", True), ("gpt2", False)])
def test_tp_needs_a_plan_for_the_models_architecture(tmp_path, demo_data, model_type, accepted):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {"model_type": model_type, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512}
        )
    )
    demo_data["model"] = {"path": str(model)}
    demo_data["training"].update(data_parallel_size=1, tensor_parallel_size=2)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    if accepted:
        assert load_job_config(config_file).training.tensor_parallel_size == 2
        return
    with pytest.raises(ConfigError) as caught:
        load_job_config(config_file)
    (problem,) = caught.value.problems
    assert problem.path == "training.tensor_parallel_size" and "model_type 'gpt2'" in problem.message


def test_any_tp_size_that_splits_the_model_is_accepted(tmp_path, demo_data):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 512}
        )
    )
    demo_data["model"] = {"path": str(model)}
    demo_data["training"].update(data_parallel_size=1, tensor_parallel_size=4)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    assert load_job_config(config_file).training.tensor_parallel_size == 4


def test_a_tiny_model_still_to_be_built_is_checked_with_the_builders_shapes(tmp_path, demo_data):
    demo_data["model"] = {"path": str(tmp_path / "not-built-yet"), "builder": "tiny-qwen2"}
    demo_data["training"].update(data_parallel_size=1, tensor_parallel_size=4)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    with pytest.raises(ConfigError) as caught:
        load_job_config(config_file)
    (problem,) = caught.value.problems
    assert problem.path == "training.tensor_parallel_size" and "num_key_value_heads (2)" in problem.message


@pytest.mark.parametrize(("strategy", "refused"), [("ddp", True), ("fsdp", False)])
def test_tp_on_a_moe_model_runs_under_fsdp_only(tmp_path, demo_data, strategy, refused):
    """Qwen3-MoE's TP plan splits its attention only, its experts are EP's: built and run under FSDP, not in
    the TP layout."""
    model = tmp_path / "model"
    model.mkdir()
    shape = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "num_experts": 4}
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **shape}))
    demo_data["model"] = {"path": str(model)}
    demo_data["training"].update(data_parallel_size=1, tensor_parallel_size=2, strategy=strategy)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    if not refused:
        assert load_job_config(config_file).training.tensor_parallel_size == 2
        return
    with pytest.raises(ConfigError) as caught:
        load_job_config(config_file)
    (problem,) = caught.value.problems
    assert problem.path == "training.tensor_parallel_size" and "strategy fsdp only" in problem.message
