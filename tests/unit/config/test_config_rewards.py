"""reward.terms: each term's options must suit its name, and problems name the term's field."""

from pathlib import Path
from typing import get_args

import pytest
import yaml

from rldock.config import ConfigError, RewardSpec, RewardTermSpec, parse_job_config
from rldock.config.problem import Problem, field_path
from rldock.config.reward import TERM_OPTIONS, reward_problems

BASE = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml").read_text())


def _problems(*terms: dict) -> list[Problem]:
    return reward_problems(RewardSpec(terms=list(terms)))


def test_default_is_one_digit_match_term_that_fails_on_errors():
    spec = RewardSpec()
    assert [(t.name, t.weight) for t in spec.terms] == [("digit_match", 1.0)]
    assert spec.on_error == "fail"


def test_a_valid_mix_of_terms_has_no_problems():
    assert (
        _problems(
            {"name": "math_verify"},
            {"name": "format", "pattern": r".*####.*", "weight": 0.1},
            {"name": "function", "function": "rewards/gsm8k.py:score"},
            {"name": "function", "function": "my_pkg.rewards:score"},
            {
                "name": "remote",
                "url": "https://rm.example:8443/score",
                "timeout_s": 5,
                "max_retries": 0,
                "token_env": "RM_TOKEN",
                "batch_size": 16,
            },
        )
        == []
    )


@pytest.mark.parametrize(
    "term, path, words",
    [
        ({"name": "format"}, "reward.terms[0].pattern", "needs pattern"),
        ({"name": "function"}, "reward.terms[0].function", "needs function"),
        ({"name": "remote"}, "reward.terms[0].url", "needs url"),
        ({"name": "digit_match", "pattern": r"\d+"}, "reward.terms[0].pattern", "only a `format` term takes pattern"),
        ({"name": "math_verify", "url": "http://x:1"}, "reward.terms[0].url", "only a `remote` term takes url"),
        ({"name": "format", "pattern": ".*", "timeout_s": 3}, "reward.terms[0].timeout_s", "only a `remote` term"),
        ({"name": "function", "function": "f.py:g", "token_env": "T"}, "reward.terms[0].token_env", "only a `remote`"),
        ({"name": "format", "pattern": "(unclosed"}, "reward.terms[0].pattern", "not a Python regex"),
        (
            {"name": "function", "function": "rewards.py"},
            "reward.terms[0].function",
            "is not `path/to/file.py:function`",
        ),
        ({"name": "function", "function": "rewards.py:1st"}, "reward.terms[0].function", "is not"),
        ({"name": "function", "function": "my-pkg:score"}, "reward.terms[0].function", "is not"),
        ({"name": "remote", "url": "ftp://host/x"}, "reward.terms[0].url", "not an http:// or https:// URL"),
        ({"name": "remote", "url": "file:///etc/passwd"}, "reward.terms[0].url", "not an http:// or https:// URL"),
        ({"name": "remote", "url": "https://:8443/score"}, "reward.terms[0].url", "with a host"),
        ({"name": "remote", "url": "http://rm:port/score"}, "reward.terms[0].url", "not an http:// or https:// URL"),
        ({"name": "exact_match", "allow_insecure": True}, "reward.terms[0].allow_insecure", "only a `remote` term"),
        ({"name": "model"}, "reward.terms[0].path", "a `model` term needs path"),
        ({"name": "digit_match", "path": "/rm"}, "reward.terms[0].path", "only a `model` term takes path"),
        ({"name": "model", "path": "/rm", "url": "http://x:1"}, "reward.terms[0].url", "only a `remote` term"),
    ],
)
def test_each_wrong_option_is_named_with_its_term_index(term, path, words):
    (problem,) = _problems(term)
    assert problem.path == path and words in problem.message


@pytest.mark.parametrize("url", ["http://rm.team-a.svc:8000/score", "HTTP://rm.team-a.svc:8000/score"])
def test_a_token_over_plain_http_is_refused_naming_the_url_and_both_fixes(url):
    (problem,) = _problems({"name": "math_verify"}, {"name": "remote", "url": url, "token_env": "RM_TOKEN"})
    assert problem.path == "reward.terms[1].url"
    assert "token_env RM_TOKEN unencrypted" in problem.message
    assert "use an https:// URL, or set allow_insecure: true" in problem.message


@pytest.mark.parametrize(
    "term",
    [
        {"url": "http://127.0.0.1:8000/score", "token_env": "RM_TOKEN", "allow_insecure": True},  # a sidecar
        {"url": "https://rm.example/score", "token_env": "RM_TOKEN"},
        {"url": "http://rm.team-a.svc:8000/score"},  # no token to leak
        {"url": "http://rm.team-a.svc:8000/score", "allow_insecure": False},
    ],
)
def test_plain_http_is_fine_without_a_token_or_when_allowed(term):
    assert _problems({"name": "remote", **term}) == []


def test_allow_insecure_false_refuses_like_unset():
    (problem,) = _problems({"name": "remote", "url": "http://rm:1/s", "token_env": "T", "allow_insecure": False})
    assert problem.path == "reward.terms[0].url"


def test_the_job_loader_refuses_a_token_over_plain_http():
    term = {"name": "remote", "url": "http://rm:8000/score", "token_env": "RM_TOKEN"}
    (problem,) = _job({"terms": [term]})
    assert problem.path == "reward.terms[0].url" and "allow_insecure" in problem.message
    parse_job_config({**BASE, "reward": {"terms": [{**term, "allow_insecure": True}]}})


def test_problems_name_the_index_of_the_term_at_fault():
    problems = _problems({"name": "digit_match"}, {"name": "format"}, {"name": "exact_match", "batch_size": 4})
    assert [p.path for p in problems] == ["reward.terms[1].pattern", "reward.terms[2].batch_size"]


def test_the_job_loader_reports_reward_problems_and_schema_errors_with_indexed_paths():
    data = {**BASE, "reward": {"terms": [{"name": "math_verify"}, {"name": "remote"}]}}
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    assert [p.path for p in caught.value.problems] == ["reward.terms[1].url"]
    data = {**BASE, "reward": {"terms": [{"name": "math_verify"}, {"name": "sandbox"}], "on_error": "skip"}}
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    assert [p.path for p in caught.value.problems] == ["reward.terms[1].name", "reward.on_error"]


@pytest.mark.parametrize(
    "reward, path",
    [
        ({"terms": []}, "reward.terms"),
        ({"terms": [{"name": "digit_match", "weight": 1e6}]}, "reward.terms[0].weight"),
        ({"terms": [{"name": "remote", "url": "http://x:1", "token_env": "NOT-A-NAME"}]}, "reward.terms[0].token_env"),
        ({"terms": [{"name": "remote", "url": "http://x:1", "timeout_s": 0}]}, "reward.terms[0].timeout_s"),
        ({"name": "digit_match"}, "reward.name"),  # the old form is refused, naming the field
    ],
)
def test_bad_values_are_named(reward, path):
    with pytest.raises(ConfigError) as caught:
        parse_job_config({**BASE, "reward": reward})
    assert path in [p.path for p in caught.value.problems]


def test_field_path_renders_list_indexes():
    assert field_path(["reward", "terms", 1, "url"]) == "reward.terms[1].url"
    assert field_path(["spec", "job", "reward", "terms", 0]) == "spec.job.reward.terms[0]"
    assert field_path([]) == ""


def test_the_options_table_covers_every_name_and_every_option_of_a_term():
    # A new term name or option (the reward model's `model` with `path`) must say which terms take it.
    assert set(TERM_OPTIONS) == set(get_args(RewardTermSpec.model_fields["name"].annotation))
    options = {option for required, optional in TERM_OPTIONS.values() for option in required + optional}
    assert options == set(RewardTermSpec.model_fields) - {"name", "weight"}


def test_one_model_term_is_fine_a_second_is_named():
    assert _problems({"name": "model", "path": "/rm"}, {"name": "digit_match", "weight": 0.5}) == []
    problems = _problems({"name": "model", "path": "/rm"}, {"name": "digit_match"}, {"name": "model", "path": "/rm2"})
    assert [p.path for p in problems] == ["reward.terms[2].name"]
    assert "only one `model` term per job (reward.terms[0] is one already)" in problems[0].message


def _job(reward: dict, **sections) -> list[Problem]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config({**BASE, "reward": reward, **sections})
    return caught.value.problems


def test_the_reward_model_worker_takes_a_device_share_that_must_fit():
    """Actor and reference ranks fill DP devices in pairs; a critic or a reward model takes half a
    device more, the two together one device."""
    model = {"name": "model", "path": "/rm"}
    one_device = {"resources": {"devices_per_node": 1}, "training": {"data_parallel_size": 1}}
    (problem,) = _job({"terms": [model]}, **one_device)
    assert problem.path == "resources.devices_per_node"
    assert problem.message.startswith("reward.terms[0] runs a reward-model worker besides the 1 actor")
    assert "needs 2 devices but resources give 1" in problem.message
    two_devices = {"resources": {"devices_per_node": 2}, "training": {"data_parallel_size": 1}}
    parse_job_config({**BASE, "reward": {"terms": [model]}, **two_devices})
    ppo = {**BASE["algorithm"], "name": "ppo"}
    parse_job_config({**BASE, "reward": {"terms": [model]}, "algorithm": ppo, **two_devices})  # critic + RM: 1 device
    (problem,) = _job({"terms": [model]}, algorithm=ppo, **one_device)
    assert (
        "runs 1 critic rank(s) (one per data-parallel rank) and reward.terms[0] runs a reward-model worker"
        in problem.message
    )


def test_evaluation_needs_a_term_besides_the_model():
    data = {**BASE["data"], "generator": {**BASE["data"]["generator"], "num_val_prompts": 10}}
    base = {**BASE, "evaluation": {"interval": 1}, "data": data}
    model = {"name": "model", "path": "/rm"}
    with pytest.raises(ConfigError) as caught:
        parse_job_config({**base, "reward": {"terms": [model]}})
    (problem,) = caught.value.problems
    assert problem.path == "evaluation.interval" and "other than `model`" in problem.message
    parse_job_config({**base, "reward": {"terms": [model, {"name": "math_verify", "weight": 0}]}})
