"""Job config validation: every error names the field path to fix."""

import copy
import pickle

import pytest
import yaml
from job_examples import example, problem_paths
from pydantic import ValidationError

from rldock.config import ConfigError, JobConfig, load_job_config, parse_job_config
from rldock.config.job import Ablations


@pytest.fixture
def demo_data() -> dict:
    return example()


def test_demo_config_is_valid(demo_data):
    cfg = parse_job_config(demo_data)
    assert isinstance(cfg, JobConfig)
    assert cfg.num_samples_per_iteration == 16 * 8
    assert cfg.num_devices == 8


def test_unknown_field_is_named(demo_data):
    demo_data["algorithm"]["learnig_rate"] = 0.1
    with pytest.raises(ConfigError) as caught:
        parse_job_config(demo_data)
    assert [p.path for p in caught.value.problems] == ["algorithm.learnig_rate"]
    assert "unknown field" in str(caught.value)


@pytest.mark.parametrize("section, field, value", [("rollout", "engine", "vllm")])
def test_single_valued_knobs_are_gone(demo_data, section, field, value):
    # It selected nothing; the multi-valued version comes with a second engine (training.strategy came
    # back with fsdp: tests/unit/config/test_config_strategy.py).
    demo_data.setdefault(section, {})[field] = value
    assert problem_paths(demo_data) == [f"{section}.{field}"]


def test_missing_required_field_is_named(demo_data):
    del demo_data["algorithm"]["num_responses_per_prompt"]
    assert problem_paths(demo_data) == ["algorithm.num_responses_per_prompt"]


@pytest.mark.parametrize(
    "path, value",
    [
        (("algorithm", "num_responses_per_prompt"), 1),
        (("algorithm", "learning_rate"), -1.0),
        (("rollout", "top_p"), 1.5),
        (("resources", "device"), "tpu"),
        (("training", "data_parallel_size"), 0),
        # bounds the runtime asserts rather than checks again (issue 65)
        (("algorithm", "clip_ratio_c"), 1.0),
        (("dock", "max_staleness"), -1),
        (("dock", "on_stale"), "skip"),
        (("model", "dtype"), "float8"),
        (("training", "context_parallel_mode"), "blocks"),
        (("training", "resharding"), "gather"),
    ],
)
def test_bad_values_are_named(demo_data, path, value):
    demo_data.setdefault(path[0], {})[path[1]] = value
    assert problem_paths(demo_data) == [".".join(path)]


def test_dp_must_divide_samples(demo_data):
    demo_data["training"]["data_parallel_size"] = 3  # 128 samples over 3 ranks
    with pytest.raises(ConfigError) as caught:
        parse_job_config(demo_data)
    (problem,) = caught.value.problems
    assert problem.path == "training.data_parallel_size"
    assert "128" in problem.message


def test_dp_cannot_exceed_devices(demo_data):
    demo_data["training"]["data_parallel_size"] = 16
    demo_data["resources"]["devices_per_node"] = 4
    paths = problem_paths(demo_data)
    assert paths == ["training.data_parallel_size"]


def test_all_problems_reported_at_once(demo_data):
    data = copy.deepcopy(demo_data)
    data["dock"]["num_warehouses"] = 99
    data["evaluation"] = {"interval": 5}  # no held-out prompts to evaluate on
    assert sorted(problem_paths(data)) == ["dock.num_warehouses", "evaluation.interval"]


def test_central_dock_refuses_distributed_only_settings(demo_data):
    data = copy.deepcopy(demo_data)
    data["dock"].update(mode="central", num_warehouses=2)
    assert sorted(problem_paths(data)) == ["dock.num_warehouses"]
    data["dock"].update(num_warehouses=1)
    assert parse_job_config(data).dock.mode == "central"


@pytest.mark.parametrize(
    "section, field",
    [
        ("algorithm", "fuse_reward_advantage"),
        ("training", "background_bookkeeping"),
        ("dock", "colocate_controllers"),
        ("dock", "shared_memory"),
        (None, "_ablations"),
        (None, "ablations"),
    ],
)
def test_the_benchmarks_switches_are_no_config_fields(demo_data, section, field):
    """The optimisations the benchmarks turn off are set in code (JobConfig.with_ablations): a
    config naming one is refused as an unknown field, and the private attribute is out of reach."""
    data = copy.deepcopy(demo_data)
    (data.setdefault(section, {}) if section else data)[field] = False
    path = f"{section}.{field}" if section else field
    with pytest.raises(ConfigError) as refused:
        parse_job_config(data)
    assert [p.path for p in refused.value.problems] == [path]
    assert "not permitted" in str(refused.value) or "unknown" in str(refused.value)


def test_a_benchmark_turns_an_optimisation_off_in_code(demo_data):
    cfg = parse_job_config(copy.deepcopy(demo_data))
    assert cfg.ablations == Ablations()  # every optimisation on
    off = cfg.with_ablations(shared_memory=False)
    assert (off.ablations.shared_memory, off.ablations.colocate_controllers, cfg.ablations.shared_memory) == (
        False,
        True,
        True,
    )
    assert off.model_dump() == cfg.model_dump()  # not part of the config written or shipped as YAML
    assert pickle.loads(pickle.dumps(off)).ablations == off.ablations  # as Ray ships it to the workers
    with pytest.raises(ValidationError):
        cfg.with_ablations(no_such_switch=False)


def test_missing_model_dir_is_named(tmp_path, demo_data):
    demo_data["model"] = {"path": str(tmp_path / "nope")}
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    with pytest.raises(ConfigError) as caught:
        load_job_config(config_file)
    assert [p.path for p in caught.value.problems] == ["model.path"]
    # The same config passes when only config-level rules are checked (the operator's view).
    assert load_job_config(config_file, check_local=False).model.path.endswith("nope")


def test_overrides_apply_dotted_paths(tmp_path, demo_data):
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(demo_data))
    cfg = load_job_config(config_file, overrides={"algorithm.learning_rate": 0.0})
    assert cfg.algorithm.learning_rate == 0.0


def test_bad_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_job_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_job_config(broken)


def test_an_rljob_manifest_is_refused_naming_spec_job_and_the_dry_run(tmp_path):
    manifest = tmp_path / "rljob.yaml"
    manifest.write_text(
        yaml.safe_dump({"apiVersion": "rldock.io/v1alpha1", "kind": "RLJob", "spec": {"job": example()}})
    )
    with pytest.raises(ConfigError, match=r"RLJob manifest; its job config is spec\.job.*--dry-run=server") as error:
        load_job_config(manifest, check_local=False)
    assert [p.path for p in error.value.problems] == ["kind"]
