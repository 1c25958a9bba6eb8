"""Config rules for routing replay (algorithm.routing_replay) and the flow it adds to the job's recipe."""

import json

import pytest
from job_examples import example, problem_messages

from rldock.config import find_local_problems, parse_job_config
from rldock.runtime.flow.job_recipe import job_recipe, recomputes_old_logprobs

FIELD = "algorithm.routing_replay"


def _replaying(mode: str = "reference", **algorithm) -> dict:
    data = example()
    data["algorithm"].update(routing_replay=mode, **algorithm)
    return data


def test_off_by_default_and_no_routing_column():
    cfg = parse_job_config(example())
    recipe = job_recipe(cfg)
    assert cfg.algorithm.routing_replay == "off"
    assert all("routed_experts" not in columns for columns in recipe.produces.values())


def test_reference_runs_the_old_logprob_pass_which_writes_the_routing_the_update_reads():
    cfg = parse_job_config(_replaying())
    assert cfg.algorithm.num_updates_per_iteration == 1 and recomputes_old_logprobs(cfg)  # `auto` would skip it
    recipe = job_recipe(cfg)
    assert "routed_experts" in recipe.produces["actor_inference"] and "routed_experts" in recipe.consumes["update"]


def test_rollout_is_refused_naming_the_fix():
    (message,) = problem_messages(_replaying("rollout"), FIELD)
    assert "Model Runner V2" in message and "use `reference`" in message


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"recompute_old_logprobs": "never"}, "recompute_old_logprobs"),
        ({"name": "dpo", "num_responses_per_prompt": 2}, "DPO"),
    ],
)
def test_reference_needs_an_old_logprob_pass(change, expected):
    data = _replaying()
    data["algorithm"].update(change)
    assert any(expected in message for message in problem_messages(data, FIELD))


def test_reference_with_context_parallelism_is_valid():
    """Each CP rank records and replays its own tokens (tests/ranks/test_context_expert_parallel_ranks.py)."""
    data = _replaying()
    data["training"].update(strategy="fsdp", context_parallel_size=2)
    assert parse_job_config(data).algorithm.routing_replay == "reference"


def test_a_dense_model_is_named(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2}))
    data = _replaying()
    data["model"] = {"path": str(model_dir)}
    problems = find_local_problems(parse_job_config(data))
    assert [p.path for p in problems] == [FIELD] and "needs an MoE model" in problems[0].message


@pytest.mark.parametrize(("section", "field"), [("algorithm", "routing_replay"), ("rollout", "partial_rollout")])
def test_a_yaml_bare_off_is_the_off_mode(section, field):
    import yaml

    data = example()
    data.setdefault(section, {}).update(yaml.safe_load(f"{field}: off"))  # YAML 1.1: false
    assert getattr(getattr(parse_job_config(data), section), field) == "off"


@pytest.mark.parametrize(
    ("section", "change", "named"),
    [
        ("rollout", {"stream_groups": 2}, "rollout.stream_groups"),
        ("training", {"mode": "async"}, None),  # async alone is fine with the plain rollout
    ],
)
def test_return_logprobs_is_the_plain_rollouts(section, change, named):
    data = example()
    data.setdefault("rollout", {})["return_logprobs"] = True
    data.setdefault(section, {}).update(change)
    if named is None:
        assert parse_job_config(data).rollout.return_logprobs
        return
    (message,) = problem_messages(data, "rollout.return_logprobs")
    assert named in message
