"""Every config in examples/ validates: the examples are what a new user copies first. Their headers'
commands (`rldock plan` among them) run as written in tests/integration/test_examples_as_written.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rldock.runtime.cli import main
from rldock_e2e.example_headers import header_commands

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _job_config(path: Path) -> dict:
    """The job config of an example: the file itself, or an RLJob manifest's spec.job."""
    data = yaml.safe_load(path.read_text())
    return data["spec"]["job"] if data.get("kind") == "RLJob" else data


def test_the_walk_finds_the_examples_and_their_plan_commands():
    names = {path.name for path in EXAMPLES}
    assert {"grpo-tiny.yaml", "rljob-tiny.yaml", "grpo-qwen2.5-32b-paper.yaml"} <= names
    plans = {path.name for path in EXAMPLES if any(c.startswith("rldock plan ") for c in header_commands(path))}
    assert plans >= {"grpo-qwen2.5-7b-paper.yaml", "grpo-qwen2.5-32b-paper.yaml", "grpo-deepseek-r1-671b-paper.yaml"}


def _tools(config: dict) -> list[dict]:
    return (config.get("agent") or {}).get("tools") or []


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_every_example_validates(path, tmp_path, capsys):
    """Examples whose model the runtime builds validate with the path checks too; the others name
    folders of another machine (a model to import, an RLJob's volumes), so their paths are not
    checked here."""
    config = _job_config(path)
    written = tmp_path / path.name
    written.write_text(yaml.safe_dump(config))
    built = config["model"].get("builder") is not None
    code = main(["validate", str(written)] + ([] if built else ["--no-path-checks"]))
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err == ""  # no warning either: an example shows settings to copy
    verdict, *rest = captured.out.splitlines()
    assert verdict.startswith("ok: ")
    # and, for an example with the python tool, the sandbox layers this machine has (one line)
    sandbox = [line for line in rest if line.startswith("the python tool's sandbox on this machine: ")]
    assert rest == sandbox and len(sandbox) == ("python" in {tool["name"] for tool in _tools(config)})
