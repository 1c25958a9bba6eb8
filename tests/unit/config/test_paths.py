"""The job config's path fields are expanded (`~`, `$VARS`) once, by the loader: each field the model
marks, found by walking the model, with `~`, `$HOME` and `${VAR}` forms (config/paths.py)."""

from __future__ import annotations

import json
import os
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from rldock.config import ConfigError, load_job_config
from rldock.config.job import JobConfig
from rldock.config.loading import PathExpansion
from rldock.config.paths import _marker, _sections, expand_paths, expand_text, path_fields
from rldock.config.section import COMMAND, PATH

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
ENVIRON = {"HOME": "/home/tester", "DATA": "/srv/data"}
HERE = "<here>"  # where a setting puts the text under test

# For each path field, an example and the overrides (`--set`) that give it a value: a field the model
# marks without a row here fails test_every_path_field_has_a_setting, so none is left untested.
SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "model.path": ("grpo-smollm2-math.yaml", {"model.path": HERE}),
    "data.train_files": ("grpo-smollm2-math.yaml", {"data.train_files": [HERE, "/abs/other.jsonl"]}),
    "data.val_files": ("grpo-smollm2-math.yaml", {"data.val_files": [HERE]}),
    "reward.terms[].function": (
        "grpo-smollm2-math.yaml",
        {"reward.terms": [{"name": "math_verify"}, {"name": "function", "function": HERE}]},
    ),
    "reward.terms[].path": (
        "grpo-smollm2-math.yaml",
        {"reward.terms": [{"name": "math_verify"}, {"name": "model", "path": HERE}], "resources.devices_per_node": 2},
    ),
    "agent.tools[].name": ("agent-smollm2-python.yaml", {"agent.tools": [{"name": "python"}, {"name": HERE}]}),
    # as the cabinet example's header shows: the environment's class in the actor's process
    "agent.environment.name": ("agent-smollm2-cabinet.yaml", {"agent.environment": {"name": HERE}}),
    "agent.environment.servers.command": (
        "agent-smollm2-cabinet.yaml",
        {"agent.environment.servers.command": ["rldock", "env", "serve", HERE, "--port", "{port}"]},
    ),
    "agent.harness": (
        "grpo-smollm2-math.yaml",
        {"agent": {"harness": HERE}, "evaluation.interval": 0, "data.val_files": []},
    ),
    "agent.harness_command": (
        "grpo-smollm2-math.yaml",
        {"agent": {"harness_command": ["python", HERE]}, "evaluation.interval": 0, "data.val_files": []},
    ),
    "agent.harness_request": (
        "grpo-smollm2-math.yaml",
        {
            "agent": {"harness_command": ["python", "agent.py"], "harness_request": HERE},
            "evaluation.interval": 0,
            "data.val_files": [],
            "data.system_prompt": None,  # the captured request's system messages take its place
        },
    ),
    "agent.sandbox.servers.command": (
        "agent-smollm2-python.yaml",
        {"agent.sandbox.servers": {"command": ["rldock", "env", "serve", HERE, "--port", "{port}"]}},
    ),
}

# Every other free-text field of the config, none a path on this machine: a new string field must be
# marked (job.Expanded) or listed here, so a path field cannot be added without a decision.
NOT_PATHS = {
    "name",  # the job's name
    "data.prompt_key",  # columns of the data files
    "data.answer_key",
    "data.data_source_key",
    "data.extra_info_key",
    "data.chosen_key",
    "data.rejected_key",
    "data.demonstration_key",
    "data.system_prompt",  # text given to the model
    "reward.terms[].pattern",  # a regex
    "reward.terms[].url",  # a network address
    "reward.terms[].token_env",  # a variable's name, read by the reward worker
    "agent.tools[].options",  # the user's class reads its options itself
    "agent.environment.options",
    "agent.environment.servers.url",
    "agent.environment.servers.service",  # an RLJob's entry
    "agent.environment.action_field",  # fields of the environment's messages
    "agent.environment.observation_field",
    "agent.sandbox.servers.url",
    "agent.sandbox.servers.service",
    "agent.environment.servers.env",  # variables handed to a local server process, as written
    "agent.sandbox.servers.env",
    "agent.served_models",  # model names a harness may give
    "training.lora.target_modules",  # module names
    "resources.accelerator_resource",  # a Ray resource
    "wandb.project",
    "wandb.entity",
}


def _text_fields(model: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, FieldInfo) of every field under `model` whose type holds a plain str."""

    def holds_str(annotation: Any) -> bool:
        return annotation is str or any(holds_str(arg) for arg in typing.get_args(annotation))

    found = []
    for name, info in model.model_fields.items():
        at = f"{prefix}.{name}" if prefix else name
        sections = _sections(info.annotation)
        if sections:
            for section, in_list in sections:
                found += _text_fields(section, f"{at}[]" if in_list else at)
        elif holds_str(info.annotation):
            found.append((at, info))
    return found


def test_every_text_field_is_a_path_or_listed_as_none():
    unmarked = {at for at, info in _text_fields(JobConfig) if _marker(info.metadata) is None}
    assert unmarked == NOT_PATHS


def test_every_path_field_has_a_setting():
    assert {field for field, _ in path_fields()} == set(SETTINGS)


def _values_at(dump: Any, field: str) -> list[str]:
    """The strings at a dotted field of a model_dump (`[]`: every item; a list value is flattened)."""
    values = [dump]
    for part in field.split("."):
        name, listed = part.removesuffix("[]"), part.endswith("[]")
        values = [value[name] for value in values if isinstance(value, dict) and value.get(name) is not None]
        if listed:
            values = [item for value in values for item in value]
    return [text for value in values for text in (value if isinstance(value, list) else [value])]


def _load(tmp_path: Path, field: str, text: str, *, paths: PathExpansion = "here") -> JobConfig:
    name, overrides = SETTINGS[field]
    placed = json.loads(json.dumps(overrides).replace(json.dumps(HERE)[1:-1], text))
    config = tmp_path / name
    config.write_text((EXAMPLES / name).read_text())
    return load_job_config(config, overrides=placed, check_local=False, environ=ENVIRON, paths=paths)


# (text written, expanded in a path or a reference, expanded in a command's argument)
FORMS = [
    ("~/jobs/own.py:Thing", "/home/tester/jobs/own.py:Thing", "/home/tester/jobs/own.py:Thing"),
    ("$HOME/jobs/own.py:Thing", "/home/tester/jobs/own.py:Thing", "$HOME/jobs/own.py:Thing"),
    ("${DATA}/own.py:Thing", "/srv/data/own.py:Thing", "${DATA}/own.py:Thing"),
    ("/abs/own.py:Thing", "/abs/own.py:Thing", "/abs/own.py:Thing"),
]


@pytest.mark.parametrize("form", FORMS, ids=[form[0] for form in FORMS])
@pytest.mark.parametrize(("field", "marker"), path_fields(), ids=[field for field, _ in path_fields()])
def test_each_path_field_is_expanded_by_the_loader(tmp_path, field, marker, form):
    written, in_path, in_command = form
    cfg = _load(tmp_path, field, written)
    expected = in_path if marker == PATH else in_command
    assert marker in (PATH, COMMAND)
    values = _values_at(cfg.model_dump(), field)
    assert expected in values and (expected == written or written not in values)
    assert "~/" not in cfg.model_dump_json()  # nor the example's own paths: what config.json holds


@pytest.mark.parametrize("field", [field for field, marker in path_fields() if marker == PATH])
def test_an_unset_variable_names_the_field_unless_the_config_runs_elsewhere(tmp_path, field):
    with pytest.raises(ConfigError) as caught:
        _load(tmp_path, field, "$NOT_SET_HERE/own.py:Thing")
    (problem,) = caught.value.problems
    assert re.sub(r"\[\d+\]", "[]", problem.path).removesuffix("[]") == field  # the item, named
    assert "$NOT_SET_HERE is not set" in problem.message
    cfg = _load(tmp_path, field, "$NOT_SET_HERE/own.py:Thing", paths="if_set")
    assert "$NOT_SET_HERE/own.py:Thing" in _values_at(cfg.model_dump(), field)


def test_a_config_that_runs_elsewhere_keeps_its_paths_as_written(tmp_path):
    """`validate --no-path-checks` (--print shows what the other machine will read): nothing expanded."""
    cfg = _load(tmp_path, "data.train_files", "~/data/$RLDOCK_TEST_MODELS/train.jsonl", paths="as_written")
    assert cfg.data.train_files[0] == "~/data/$RLDOCK_TEST_MODELS/train.jsonl"


def test_the_resolved_config_loads_again_unchanged(tmp_path):
    """config.json (the resolved config a run writes) read back gives the same config: expansion is
    done once and a second pass changes nothing, so a resumed run compares equal."""
    cfg = _load(tmp_path, "data.train_files", "~/data/train.jsonl")
    written = tmp_path / "config.json"
    written.write_text(cfg.model_dump_json())
    assert load_job_config(written, check_local=False, environ=ENVIRON) == cfg
    assert expand_paths(cfg, environ=ENVIRON) == (cfg, [])


def test_the_process_environment_is_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLDOCK_TEST_MODELS", "/models")
    config = tmp_path / "job.yaml"
    config.write_text((EXAMPLES / "grpo-smollm2-math.yaml").read_text())
    cfg = load_job_config(config, overrides={"data.val_files": ["$RLDOCK_TEST_MODELS/val.jsonl"]}, check_local=False)
    assert cfg.model.path == f"{tmp_path}/home/.cache/rldock/models/SmolLM2-135M-Instruct"
    assert cfg.data.val_files == ["/models/val.jsonl"]


@pytest.mark.parametrize(
    ("text", "variables", "expanded", "unset"),
    [
        ("~", True, "/home/tester", []),
        ("~/", True, "/home/tester/", []),
        ("a/~/b", True, "a/~/b", []),  # only a leading `~`, as in a shell
        ("~no-such-user-here/x", True, "~no-such-user-here/x", []),
        ("$HOME$DATA", True, "/home/tester/srv/data", []),
        ("cost$$5/$5/x$", True, "cost$5/$5/x$", []),  # `$$` is a literal `$`; `$5` and a last `$` stay
        ("${DATA}x/$DATAx", True, "/srv/datax/$DATAx", ["DATAx"]),
        ("$HOME/x", False, "$HOME/x", []),
        ("~/x", False, "/home/tester/x", []),
    ],
)
def test_expand_text(text, variables, expanded, unset):
    assert expand_text(text, variables=variables, environ=ENVIRON) == (expanded, unset)


def test_without_home_the_user_database_says_it():
    import pwd

    home = pwd.getpwuid(os.getuid()).pw_dir.rstrip("/")
    assert expand_text("~/x", variables=True, environ={}) == (f"{home}/x", [])


def test_a_home_of_slash_gives_no_double_slash():
    assert expand_text("~/x", variables=True, environ={"HOME": "/"}) == ("/x", [])
    assert expand_text("~", variables=True, environ={"HOME": "/"}) == ("/", [])


def test_the_operator_leaves_the_fields_as_written(tmp_path):
    """An RLJob's spec.job is validated by the operator, whose home and environment are not the
    pods': parsing it (what admission and the ConfigMap's renderer do) expands nothing."""
    from rldock.config import parse_job_config

    data = yaml.safe_load((EXAMPLES / "grpo-smollm2-math.yaml").read_text())
    data["data"]["train_files"] = ["$DATA/train.jsonl"]
    cfg = parse_job_config(data)
    assert cfg.model.path.startswith("~/") and cfg.data.train_files == ["$DATA/train.jsonl"]
