"""Preflight: configured paths are checked before Ray starts, each problem naming field and path."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.config.agent import AgentSpec
from rldock.contract.failure import FailureReason
from rldock.runtime.models.tiny import train_char_tokenizer
from rldock.runtime.preflight import (
    CHECKS,
    MOUNT_HINT,
    PathCheck,
    PathKind,
    command_files,
    find_path_problems,
    function_file,
    output_problems,
    preflight,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml"


def _config(model_path: Path | str, *, builder: bool = False, **training):
    data = yaml.safe_load(EXAMPLE.read_text())
    data["model"]["path"] = str(model_path)
    if not builder:
        data["model"].pop("builder", None)
    data.setdefault("training", {}).update(training)
    return parse_job_config(data)


def _model_dir(root: Path, **config) -> Path:
    """A folder the model checks accept: a config.json with the shape the TP checks read, a weights
    file (never loaded here) and a real tokenizer."""
    root.mkdir(parents=True)
    shape = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512}
    (root / "config.json").write_text(json.dumps({**shape, **config}))
    (root / "model.safetensors").write_bytes(b"")
    train_char_tokenizer(["0123456789+="]).save_pretrained(root)
    return root


def test_a_model_that_is_there_passes(tmp_path):
    assert preflight(_config(_model_dir(tmp_path / "m")), output=tmp_path / "runs" / "x") is None


def test_a_missing_model_names_the_field_the_path_and_the_mount(tmp_path):
    failure = preflight(_config(tmp_path / "models" / "qwen"))
    assert failure is not None and failure.reason is FailureReason.PATH_NOT_FOUND
    (problem,) = failure.problems
    assert problem.field == "model.path"
    assert problem.message == (
        f"{tmp_path}/models/qwen does not exist (nearest existing folder: {tmp_path}); {MOUNT_HINT}"
    )
    assert "spec.volumes/volumeMounts" in problem.message


def test_a_model_the_runtime_builds_need_not_exist(tmp_path):
    assert find_path_problems(_config(tmp_path / "absent", builder=True)) == []


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda p: p.write_text("x"), "is not a directory"),
        (lambda p: (p.mkdir(), (p / "model.gguf").write_text("")), "has no config.json"),
    ],
)
def test_a_model_path_that_is_no_model_directory(tmp_path, make, says):
    path = tmp_path / "m"
    make(path)
    (problem,) = find_path_problems(_config(path))
    assert problem.path == "model.path" and says in problem.message


def test_a_folder_without_config_json_says_what_it_holds(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    for name in ("a.gguf", "b", "c", "d", "e", "f", "g", "..data"):
        (path / name).write_text("")
    (problem,) = find_path_problems(_config(path))
    assert "(it holds: a.gguf, b, c, d, e, ... (2 more))" in problem.message


def _deny_access(monkeypatch, denied: Path) -> None:
    """Test double for permissions: these tests may run as root, whom chmod does not stop, so
    os.access answers False for `denied` (and only for it)."""
    real = os.access
    monkeypatch.setattr(
        "rldock.runtime.preflight.os.access", lambda path, mode: Path(path) != denied and real(path, mode)
    )


def test_an_unreadable_model_directory(tmp_path, monkeypatch):
    path = _model_dir(tmp_path / "m")
    _deny_access(monkeypatch, path)
    (problem,) = find_path_problems(_config(path))
    assert problem.message.startswith(f"{path} is not readable by this process (uid ")


def test_list_fields_are_one_row_and_keep_their_indexes(tmp_path):
    """How the data and reward fields plug in: `{i}` in the field, None to skip an entry."""
    present = tmp_path / "train.jsonl"
    present.write_text("{}\n")
    checks = (
        PathCheck(
            "data.train_files[{i}]", lambda cfg: [str(present), None, str(tmp_path / "val.jsonl")], PathKind.FILE
        ),
        PathCheck("data.dir", lambda cfg: str(present), PathKind.DIR),
    )
    problems = find_path_problems(_config(tmp_path, builder=True), checks=checks)
    assert [p.path for p in problems] == ["data.train_files[2]", "data.dir"]
    assert "is not a directory" in problems[1].message


def test_every_check_names_a_field_and_a_kind():
    assert CHECKS and all(c.field and isinstance(c.kind, PathKind) for c in CHECKS)


def test_the_output_must_be_writable(tmp_path):
    assert output_problems(tmp_path / "new" / "deeper") == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    (problem,) = output_problems(blocker / "out")
    assert problem.path == "--output" and "is not a directory" in problem.message


def test_a_read_only_output_parent(tmp_path, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    _deny_access(monkeypatch, parent)
    (problem,) = output_problems(parent / "out" / "run")
    assert problem.path == "--output" and f"{parent} is not writable" in problem.message


def test_a_model_the_config_cannot_split_is_invalid_input_once_the_path_is_there(tmp_path):
    """find_local_problems (the model's shape) runs after the path checks, as InvalidJobInput."""
    model = _model_dir(tmp_path / "m", num_attention_heads=3, num_key_value_heads=3)
    failure = preflight(_config(model, tensor_parallel_size=2))
    assert failure is not None and failure.reason is FailureReason.INVALID_JOB_INPUT
    assert [p.field for p in failure.problems] == ["training.tensor_parallel_size"]


@pytest.mark.parametrize(
    "reference, file",
    [
        ("/rewards/reward.py:score", "/rewards/reward.py"),
        ("rewards/reward.py:score", "rewards/reward.py"),
        ("my_pkg.rewards:score", None),
        ("reward.py", "reward.py"),
        (None, None),
    ],
)
def test_function_file_is_the_path_part_of_a_function_reference(reference, file):
    assert function_file(reference) == file


def test_a_missing_reward_function_file_names_its_term(tmp_path):
    cfg = _config(_model_dir(tmp_path / "m"))
    present = tmp_path / "rewards.py"
    present.write_text("def score(*args):\n    return 0.0\n")
    cfg.reward.terms = [
        {"name": "function", "function": f"{present}:score"},
        {"name": "function", "function": "my_pkg.rewards:score"},
        {"name": "function", "function": f"{tmp_path}/absent.py:score"},
    ]
    (problem,) = find_path_problems(cfg)
    assert problem.path == "reward.terms[2].function"
    assert f"{tmp_path}/absent.py does not exist" in problem.message


def test_a_model_reward_terms_folder_is_checked_as_a_model_directory(tmp_path):
    cfg = _config(tmp_path / "m", builder=True)
    rm = tmp_path / "rm"
    rm.mkdir()
    cfg = cfg.model_copy(
        update={
            "reward": cfg.reward.model_copy(
                update={
                    "terms": [
                        cfg.reward.terms[0],
                        cfg.reward.terms[0].model_copy(update={"name": "model", "path": str(rm)}),
                    ]
                }
            )
        }
    )
    (problem,) = find_path_problems(cfg)
    assert problem.path == "reward.terms[1].path" and "has no config.json" in problem.message
    _model_dir(rm / "ok")
    cfg.reward.terms[1].path = str(rm / "ok")
    assert find_path_problems(cfg) == []


def test_a_missing_agent_tool_or_environment_file_names_its_field(tmp_path):
    cfg = _config(_model_dir(tmp_path / "m"))
    present = tmp_path / "tools.py"
    present.write_text("class Echo:\n    pass\n")
    cfg.agent = AgentSpec(
        tools=[{"name": "python"}, {"name": f"{present}:Echo"}, {"name": "my_pkg.tools:Echo"}, {"name": "gone.py:T"}],
        environment={"name": f"{tmp_path}/envs.py:Judge"},
    )
    problems = find_path_problems(cfg)
    assert [p.path for p in problems] == ["agent.tools[3].name", "agent.environment.name"]
    assert problems[1].message.startswith(f"{tmp_path}/envs.py does not exist")


def test_an_agent_file_without_its_class_names_the_field_and_lists_its_classes(tmp_path):
    cfg = _config(_model_dir(tmp_path / "m"))
    (tmp_path / "tools.py").write_text("class Echo:\n    pass\n\ndef echo():\n    pass\n")
    cfg.agent = AgentSpec(tools=[{"name": f"{tmp_path}/tools.py:Echo"}, {"name": f"{tmp_path}/tools.py:Ecko"}])
    failure = preflight(cfg)
    assert failure is not None and failure.reason is FailureReason.INVALID_JOB_INPUT
    (problem,) = failure.problems
    assert problem.field == "agent.tools[1].name"
    assert "defines no 'Ecko' at its top level (its classes: ['Echo'])" in problem.message


def test_a_job_with_context_parallelism_starts_unless_the_heads_do_not_divide(tmp_path):
    """rldock train seats CP ranks: preflight lets a CP job start (an MoE model's too, with EP over the
    CP ranks), and refuses one whose model's KV heads CP cannot split (Ulysses gives each CP rank 1/cp
    of them), or whose experts EP cannot, naming the field and the sizes that would."""
    model = _model_dir(tmp_path / "m")
    assert preflight(_config(model, strategy="fsdp", context_parallel_size=2)) is None
    failure = preflight(_config(model, strategy="fsdp", context_parallel_size=4))
    assert failure is not None and failure.reason is FailureReason.INVALID_JOB_INPUT
    assert [problem.field for problem in failure.problems] == ["training.context_parallel_size"]
    assert "num_key_value_heads=2 does not; choose one of [1, 2]" in failure.problems[0].message
    # an MoE model under CP, its experts split over EP 4 of the 2 x 2 sequence ranks, starts
    experts = _model_dir(tmp_path / "moe", num_experts=4)
    assert preflight(_config(experts, strategy="fsdp", context_parallel_size=2, expert_parallel_size=4)) is None
    uneven = _model_dir(tmp_path / "moe6", num_experts=6)  # 6 experts do not split over EP 4
    failure = preflight(_config(uneven, strategy="fsdp", context_parallel_size=2, expert_parallel_size=4))
    assert failure is not None and [problem.field for problem in failure.problems] == ["training.expert_parallel_size"]
    assert "must divide the model's 6 experts" in failure.problems[0].message


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("def run(task, client):\n    return 1\n", "is not `async def`"),
        ("async def run(task):\n    return 1\n", "cannot be called as run(task, client)"),
        ("import no_such_package_here\nasync def run(task, client):\n    return 1\n", "no_such_package_here"),
    ],
)
def test_validate_imports_the_harness_and_checks_its_signature(tmp_path, source, says):
    cfg = _config(_model_dir(tmp_path / "m"))
    (tmp_path / "agent.py").write_text(source)
    cfg.agent = AgentSpec(harness=f"{tmp_path}/agent.py:run")
    failure = preflight(cfg)
    assert failure is not None and failure.reason is FailureReason.INVALID_JOB_INPUT
    (problem,) = failure.problems
    assert problem.field == "agent.harness" and says in problem.message


def test_a_missing_harness_file_or_program_names_its_field(tmp_path):
    cfg = _config(_model_dir(tmp_path / "m"))
    cfg.agent = AgentSpec(harness=f"{tmp_path}/gone.py:run")
    assert [p.path for p in find_path_problems(cfg)] == ["agent.harness"]
    cfg.agent = AgentSpec(harness_command=["no-such-program-rldock", "--go"])
    failure = preflight(cfg)
    assert failure is not None and [p.field for p in failure.problems] == ["agent.harness_command"]
    (tmp_path / "ok.py").write_text("async def run(task, client):\n    return 1.0\n")
    cfg.agent = AgentSpec(harness=f"{tmp_path}/ok.py:run")
    assert preflight(cfg) is None


@pytest.mark.parametrize(
    ("command", "files"),
    [
        (["python", "agent.py"], [None, "agent.py"]),
        (["python3.11", "-u", "-X", "dev", "-Wignore", "a.py", "--flag"], [None, None, None, None, None, "a.py", None]),
        (["/venv/bin/python", "-m", "agent"], ["/venv/bin/python", None, None]),  # a module, not a file
        (["python", "-uc", "print(1)"], [None, None, None]),
        (["bash", "-euo", "pipefail", "run.sh", "x"], [None, None, None, "run.sh", None]),
        (["sh", "-c", "./run.sh"], [None, None, None]),  # a script's text, not a file
        (["./agent", "task.json"], ["./agent", None]),  # the program as a path; its arguments are its own
        (["my-agent", "agent.py"], [None, None]),  # not an interpreter: its arguments are its own
    ],
)
def test_the_files_a_harness_command_names_are_its_program_path_and_its_interpreters_script(command, files):
    assert command_files(command) == files


@pytest.mark.parametrize(
    ("command", "field"),
    [
        ([sys.executable, "{tmp}/gone.py"], "agent.harness_command[1]"),
        ([sys.executable, "-u", "-X", "dev", "gone.py"], "agent.harness_command[4]"),  # relative: to the cwd
        (["bash", "-eo", "pipefail", "{tmp}/gone.sh"], "agent.harness_command[3]"),
        (["{tmp}/gone.sh", "--go"], "agent.harness_command[0]"),
    ],
)
def test_a_harness_command_whose_script_does_not_exist_names_it_and_the_fix(tmp_path, monkeypatch, command, field):
    cfg = _config(_model_dir(tmp_path / "m"))
    monkeypatch.chdir(tmp_path)
    cfg.agent = AgentSpec(harness_command=[word.format(tmp=tmp_path) for word in command])
    failure = preflight(cfg)
    assert failure is not None and failure.reason is FailureReason.PATH_NOT_FOUND
    (problem,) = failure.problems
    assert problem.field == field and "does not exist" in problem.message and MOUNT_HINT in problem.message
    # there, it passes; a code string or a module is no file
    (tmp_path / "gone.py").write_text("print(1)\n")
    cfg.agent = AgentSpec(harness_command=[sys.executable, "gone.py"])
    assert preflight(cfg) is None
    cfg.agent = AgentSpec(harness_command=[sys.executable, "-c", "missing.py"])
    assert preflight(cfg) is None


def test_a_harness_program_that_is_not_executable_says_how_to_run_it(tmp_path):
    cfg = _config(_model_dir(tmp_path / "m"))
    script = tmp_path / "agent.sh"
    script.write_text("echo 1\n")
    cfg.agent = AgentSpec(harness_command=[str(script)])
    failure = preflight(cfg)
    assert failure is not None and [p.field for p in failure.problems] == ["agent.harness_command[0]"]
    assert "is not executable; make it executable (chmod +x)" in failure.problems[0].message


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (None, "does not exist"),
        ("{not json", "is not readable JSON"),
        ('{"tools": {}, "messages": []}', "has `tools` that are not a list"),
        ('{"tools": [], "messages": [{"role": "system"}]}', "has `messages` that are not"),
    ],
)
def test_a_captured_harness_request_that_is_missing_or_does_not_parse_names_the_field_and_the_fix(tmp_path, text, says):
    cfg = _config(_model_dir(tmp_path / "m"))
    (tmp_path / "ok.py").write_text("async def run(task, client):\n    return 1.0\n")
    request = tmp_path / "request.json"
    if text is not None:
        request.write_text(text)
    cfg.agent = AgentSpec(harness=f"{tmp_path}/ok.py:run", harness_request=str(request))
    failure = preflight(cfg)
    assert failure is not None
    (problem,) = failure.problems
    assert problem.field == "agent.harness_request" and says in problem.message
    assert "rldock agent capture" in problem.message  # how to write one
    assert failure.reason is (FailureReason.PATH_NOT_FOUND if text is None else FailureReason.INVALID_JOB_INPUT)
    request.write_text('{"tools": [], "messages": [{"role": "system", "content": "Use the tool."}]}')
    assert preflight(cfg) is None
