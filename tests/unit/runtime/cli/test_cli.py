"""The command line reports config problems with the field path and exit code 2."""

import json
from pathlib import Path

import pytest

from rldock.contract.failure import FailureReason, last_failure
from rldock.runtime.cli import main
from rldock.runtime.cli.job_commands import run_summary

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "grpo-tiny.yaml"
MOE_EXAMPLE = EXAMPLE.with_name("grpo-tiny-moe.yaml")


def test_validate_prints_one_verdict_line(capsys):
    assert main(["validate", str(EXAMPLE)]) == 0
    captured = capsys.readouterr()
    assert captured.out == (
        f"ok: {EXAMPLE} is a valid grpo job (40 iterations, data.generator addition, 1 reward term(s)); paths checked\n"
    )
    assert captured.err == ""


def test_validate_says_which_sandbox_layers_the_machine_has(capsys):
    # A job whose python tool runs its programs here (no agent.sandbox.servers).
    agent_example = EXAMPLE.with_name("agent-smollm2-python.yaml")
    assert main(["validate", str(agent_example), "--no-path-checks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ok: ")
    assert lines[1].startswith("the python tool's sandbox on this machine: Landlock ABI ")
    assert main(["validate", str(EXAMPLE)]) == 0
    assert "the python tool's sandbox" not in capsys.readouterr().out  # no python tool


def test_validate_prints_the_resolved_config_when_asked(capsys):
    assert main(["validate", str(EXAMPLE), "--print"]) == 0
    out = capsys.readouterr().out
    assert "num_prompts_per_iteration: 16" in out and "timeout_s:" in out  # defaults filled in
    assert out.splitlines()[-1].startswith("ok: ")


def test_a_rule_that_protects_a_long_run_warns_with_what_to_set(capsys):
    assert main(["validate", str(EXAMPLE), "--set", "iterations=2"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "warning: checkpoint.interval: interval 5 exceeds iterations 2, so only the final "
        "checkpoint is written and a crash loses the whole run; set checkpoint.interval <= 2\n"
    )
    assert captured.out.startswith("ok: ")


def test_invalid_override_names_the_field(capsys):
    assert main(["validate", str(EXAMPLE), "--set", "training.data_parallel_size=3"]) == 2
    assert "training.data_parallel_size:" in capsys.readouterr().err


def test_unknown_field_override(capsys):
    assert main(["validate", str(EXAMPLE), "--set", "algorithm.lr=0.1"]) == 2
    assert "algorithm.lr: unknown field" in capsys.readouterr().err


def _missing_model_config(tmp_path: Path) -> Path:
    config = tmp_path / "job.yaml"
    config.write_text(
        EXAMPLE.read_text()
        .replace("  builder: tiny-qwen2", "")
        .replace("~/.cache/rldock/models/tiny-qwen2-addition-v1", str(tmp_path / "absent"))
    )
    return config


def test_train_refuses_a_missing_model_before_starting_anything(tmp_path, capsys):
    assert main(["train", str(_missing_model_config(tmp_path)), "--output", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert f"model.path: {tmp_path}/absent does not exist" in captured.err
    assert "spec.volumes/volumeMounts" in captured.err
    assert last_failure(captured.out.splitlines()) is None  # a person at a terminal gets no failure line
    assert not (tmp_path / "out").exists()


def test_train_for_the_operator_prints_the_failure_line(tmp_path, capsys):
    """`--no-progress` (what the operator submits): the refusal also goes out as a failure line."""
    assert (
        main(["train", str(_missing_model_config(tmp_path)), "--output", str(tmp_path / "out"), "--no-progress"]) == 2
    )
    failure = last_failure(capsys.readouterr().out.splitlines())
    assert failure is not None and failure.reason is FailureReason.PATH_NOT_FOUND
    assert [p.field for p in failure.problems] == ["model.path"]


def test_validate_checks_paths_unless_told_not_to(tmp_path, capsys):
    config = str(_missing_model_config(tmp_path))
    assert main(["validate", config]) == 2
    assert "model.path:" in capsys.readouterr().err
    assert main(["validate", config, "--no-path-checks"]) == 0


CONTEXT_PARALLEL = ["--set", "training.strategy=fsdp", "--set", "training.context_parallel_size=2"]


@pytest.mark.parametrize("path_checks", [[], ["--no-path-checks"]])
def test_validate_accepts_a_context_parallel_job_and_names_what_cannot_combine(path_checks, capsys):
    """rldock train seats CP ranks (tests/integration/test_context_parallel_job.py): validate accepts
    a CP job whether or not it checks the paths (a config checked here for an RLJob skips them), EP
    over its dp x cp ranks too, and still refuses the layouts CP does not compose with, naming the field."""
    assert main(["validate", str(EXAMPLE), *path_checks, *CONTEXT_PARALLEL]) == 0
    # the tiny MoE demo (DP 2 x EP 2) under CP 2: EP over the 2 x 2 sequence ranks
    moe = [str(MOE_EXAMPLE), *path_checks, *CONTEXT_PARALLEL, "--set", "resources.devices_per_node=4"]
    assert main(["validate", *moe]) == 0
    capsys.readouterr()
    assert main(["validate", *moe, "--set", "training.expert_parallel_size=3"]) == 2
    err = capsys.readouterr().err
    assert "training.expert_parallel_size: 3 must divide the 4 sequence ranks" in err


def test_version_prints_the_installed_version(capsys):
    import importlib.metadata

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"rldock {importlib.metadata.version('rldock')}\n"


def test_plan_reads_the_config_from_the_environment_as_validate_and_train_do(monkeypatch, capsys):
    # a preset for the model's shape: the example's tiny model is built by a run, and this test must
    # not depend on one having run on the machine before it
    monkeypatch.setenv("RLDOCK_JOB_CONFIG", str(EXAMPLE))
    assert main(["plan", "--json", "--model-preset", "qwen2.5-7b"]) == 0
    from_env = capsys.readouterr().out
    assert main(["plan", str(EXAMPLE), "--json", "--model-preset", "qwen2.5-7b"]) == 0
    assert from_env == capsys.readouterr().out and from_env.startswith("{")


@pytest.mark.parametrize(
    "rewards, window, first, last",
    [
        ([0.0], 1, 0.0, 0.0),  # one iteration: both ends are it
        ([0.0, 1.0], 1, 0.0, 1.0),
        ([0.0, 0.5, 1.0], 1, 0.0, 1.0),  # the middle one in neither half
        ([0.0, 0.2, 0.8, 1.0], 2, 0.1, 0.9),
        ([0.0] * 5 + [1.0] * 5, 5, 0.0, 1.0),
        ([0.0] * 5 + [0.5] * 10 + [1.0] * 5, 5, 0.0, 1.0),  # 5 at each end of a long run
    ],
)
def test_the_summary_line_compares_ends_that_never_overlap(rewards, window, first, last):
    records = [{"iteration": i + 1, "reward_mean": reward} for i, reward in enumerate(rewards)]
    summary = run_summary(records, output="runs/x")
    assert summary["window"] == window and summary["metric"] == "reward_mean"
    assert summary["reward_first5"] == pytest.approx(first) and summary["reward_last5"] == pytest.approx(last)


def test_agent_capture_refuses_a_job_without_a_harness_or_a_file_to_write(tmp_path, capsys):
    assert main(["agent", "capture", str(EXAMPLE), "--output", str(tmp_path / "request.json")]) == 2
    assert "the job runs no harness" in capsys.readouterr().err
    (tmp_path / "agent.py").write_text("async def run(task, client):\n    return 1.0\n")
    harness = [
        "--set",
        "data.chat_template=model",
        "--set",
        f"agent={{harness: '{tmp_path}/agent.py:run'}}",
        "--set",
        "reward.terms=[{name: environment}]",
    ]
    assert main(["agent", "capture", str(EXAMPLE), *harness]) == 2  # no agent.harness_request, no --output
    assert "--output: the config names no agent.harness_request" in capsys.readouterr().err
    assert not (tmp_path / "request.json").exists()


CAPTURED_HARNESS = """
async def run(task, client):
    tools = [{"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {}}}]
    messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": task["prompt"]}]
    await client.chat.completions.create(model="mine", messages=messages, tools=tools)
    return 1.0
"""


def test_agent_capture_writes_the_first_requests_tools_and_system_messages(tmp_path, capsys):
    (tmp_path / "agent.py").write_text(CAPTURED_HARNESS)
    request = tmp_path / "request.json"
    job = ["data.chat_template=model", f"model.path={tmp_path / 'model'}", "algorithm.max_prompt_length=64"]
    job += [f"agent={{harness: '{tmp_path}/agent.py:run', harness_request: '{request}'}}"]
    job += ["reward.terms=[{name: environment}]", "algorithm.max_response_length=16"]
    argv = ["agent", "capture", str(EXAMPLE), *(word for override in job for word in ("--set", override))]
    assert main(argv) == 0  # the tiny model built first, as the job builds it; the file the config names
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["prompt_ids_equal"] and summary["tools"] == ["add"] and summary["ended"] == "harness_done"
    assert json.loads(request.read_text()) == {
        "tools": [{"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {}}}],
        "messages": [{"role": "system", "content": "Add."}],
    }
