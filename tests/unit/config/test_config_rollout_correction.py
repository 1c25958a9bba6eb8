"""Config rules for the rollout correction (algorithm.rollout_correction) and the flow it adds to the job's
recipe: the engine's logprobs from the rollout to the old-logprob pass, the weight from there to the update."""

import math

import pytest
from job_examples import example, problem_messages

from rldock.config import find_local_problems, parse_job_config
from rldock.config.rollout_correction import PRESETS
from rldock.runtime.flow.job_recipe import job_recipe, recomputes_old_logprobs

FIELD = "algorithm.rollout_correction"


def _correcting(correction: dict | None = None, **algorithm) -> dict:
    data = example()
    data["algorithm"].update(rollout_correction={"preset": "trl"} if correction is None else correction, **algorithm)
    return data


def test_unset_by_default_and_no_correction_columns():
    cfg = parse_job_config(example())
    recipe = job_recipe(cfg)
    assert cfg.algorithm.rollout_correction is None
    assert "sampled_logprobs" not in recipe.produces["rollout"]
    assert "importance_weight" not in recipe.consumes["update"]


def test_a_correction_runs_the_old_logprob_pass_between_the_engine_s_logprobs_and_the_update():
    cfg = parse_job_config(_correcting())
    assert cfg.algorithm.num_updates_per_iteration == 1 and recomputes_old_logprobs(cfg)  # `auto` would skip it
    recipe = job_recipe(cfg)
    assert "sampled_logprobs" in recipe.produces["rollout"]
    assert "sampled_logprobs" in recipe.consumes["actor_inference"]
    assert (
        "importance_weight" in recipe.produces["actor_inference"] and "importance_weight" in recipe.consumes["update"]
    )
    assert "sampled_logprobs" not in recipe.consumes["update"]  # the weight carries what the update needs


def test_with_return_logprobs_the_rollout_writes_the_column_once():
    data = _correcting()
    data.setdefault("rollout", {})["return_logprobs"] = True
    recipe = job_recipe(parse_job_config(data))
    assert recipe.produces["rollout"].count("sampled_logprobs") == 1
    assert "sampled_logprobs" in recipe.consumes["update"]  # return_logprobs' own metric reads it there


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_sets_its_fields_and_a_field_beside_it_overrides_one(name):
    correction = parse_job_config(_correcting({"preset": name})).algorithm.rollout_correction
    assert correction is not None  # parsed: no problem
    for key, value in PRESETS[name].items():
        assert getattr(correction, key) == value, key
    changed = parse_job_config(_correcting({"preset": name, "reject_low": 0.25, "reject": "token"}))
    assert changed.algorithm.rollout_correction.reject_low == 0.25
    assert changed.algorithm.rollout_correction.weight == correction.weight


def test_the_arguments_are_the_math_s_with_an_open_band_as_infinity():
    correction = parse_job_config(_correcting({"weight": "token", "weight_cap": 4})).algorithm.rollout_correction
    assert correction.arguments() == {"weight": "token", "cap": 4.0, "reject": "none", "low": 0.0, "high": math.inf}


def test_the_resolved_config_parses_to_the_same_correction():
    """The operator writes every field of the resolved config, the preset's included."""
    cfg = parse_job_config(_correcting({"preset": "verl_seq_mis", "weight_cap": 5}))
    again = parse_job_config({**example(), "algorithm": cfg.algorithm.model_dump()})
    assert again.algorithm.rollout_correction == cfg.algorithm.rollout_correction


@pytest.mark.parametrize(
    ("correction", "path", "words"),
    [
        ({"weight": "none"}, FIELD, "corrects nothing"),
        ({"reject": "token", "weight_cap": 3}, f"{FIELD}.weight_cap", "read only with a weight"),
        ({"weight": "token", "reject_high": 3}, f"{FIELD}.reject", "set a reject or remove the band"),
        ({"reject": "sequence", "reject_low": 2, "reject_high": 2}, f"{FIELD}.reject_low", "keeps nothing"),
    ],
)
def test_a_correction_whose_fields_are_not_read_or_keep_nothing_is_refused(correction, path, words):
    (message,) = problem_messages(_correcting(correction), path)
    assert words in message


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"algorithm": {"name": "gspo"}}, "gspo"),
        ({"rollout": {"partial_rollout": "resume"}}, "rollout.partial_rollout"),
        ({"algorithm": {"recompute_old_logprobs": "never"}}, "recompute_old_logprobs never"),
    ],
)
def test_combinations_not_built_are_refused_naming_them(change, named):
    data = _correcting()
    for section, fields in change.items():
        data.setdefault(section, {}).update(fields)
    messages = problem_messages(data, FIELD)
    assert any(named in message for message in messages), messages


def _budgeted(**mismatch) -> dict:
    data = example()
    data["monitoring"] = {"mismatch": {"max_kl": 0.01, **mismatch}}
    return data


def test_a_budget_alone_measures_the_gap_without_weighting_the_update():
    cfg = parse_job_config(_budgeted(action="stop"))
    assert cfg.monitoring.mismatch is not None and recomputes_old_logprobs(cfg)
    recipe = job_recipe(cfg)
    assert "sampled_logprobs" in recipe.produces["rollout"] and "sampled_logprobs" in recipe.consumes["actor_inference"]
    assert "importance_weight" not in recipe.consumes["update"]


def test_a_budget_is_refused_where_the_gap_is_not_measured_naming_its_own_field():
    data = _budgeted()
    data["algorithm"]["name"] = "dpo"
    assert any("dpo" in message for message in problem_messages(data, "monitoring.mismatch"))


@pytest.mark.parametrize(
    "change",
    [
        {"rollout": {"stream_groups": 2}},
        {
            "rollout": {"partial_rollout": "resume", "max_tokens_per_round": 2},
            "training": {"mode": "async"},
            "dock": {"max_staleness": 1},
        },
        {
            "agent": {"tools": [{"name": "calculator"}], "max_tool_response_tokens": 2},
            "data": {"chat_template": "model"},
        },
    ],
    ids=["streamed", "partial", "agent"],
)
def test_the_streamed_partial_and_agent_rollouts_measure_the_gap(change):
    """Their rollouts write the engine's logprobs (rollout/streamed.py, rollout/partial.py,
    rollout/agent_episodes.py), which the old-logprob pass reads beside its own."""
    data = _budgeted()
    for section, fields in change.items():
        data[section] = {**data.get(section, {}), **fields}
    recipe = job_recipe(parse_job_config(data))  # refused with a ConfigError otherwise
    assert "sampled_logprobs" in recipe.produces["rollout"] and "sampled_logprobs" in recipe.consumes["actor_inference"]
    for state, columns in (*recipe.consumes.items(), *recipe.produces.items()):  # partial rollout's columns once
        assert len(set(columns)) == len(columns), (state, columns)
    assert "token_policy_version" not in recipe.produces["rollout"]  # one policy version per episode


def test_correct_needs_the_correction_it_switches_on():
    messages = problem_messages(_budgeted(action="correct"), "monitoring.mismatch.action")
    assert len(messages) == 1 and "set algorithm.rollout_correction" in messages[0], messages
    data = _budgeted(action="correct")
    data["algorithm"]["rollout_correction"] = {"preset": "trl"}
    cfg = parse_job_config(data)
    assert find_local_problems(cfg) == []
    assert "importance_weight" in job_recipe(cfg).consumes["update"]  # written from the start, 1 until switched on
