"""Every config in examples/ validates, and every `rldock plan` command an example's header shows
passes as written: the examples are what a new user copies first."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from rldock.runtime.cli import main

ROOT = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
# A command in a header comment: `#   rldock plan examples/x.yaml --flag value` (continued with `\`).
HEADER_COMMAND = re.compile(r"^#\s+(rldock plan .*)$")


def _job_config(path: Path) -> dict:
    """The job config of an example: the file itself, or an RLJob manifest's spec.job."""
    data = yaml.safe_load(path.read_text())
    return data["spec"]["job"] if data.get("kind") == "RLJob" else data


def _header_plan_commands(path: Path) -> list[str]:
    commands, lines = [], path.read_text().splitlines()
    for index, line in enumerate(lines):
        if not line.startswith("#"):
            break  # the header ends at the first line that is not a comment
        match = HEADER_COMMAND.match(line)
        if match:
            command, following = match.group(1), iter(lines[index + 1 :])
            while command.endswith("\\"):
                command = command[:-1] + next(following).lstrip("#")
            commands.append(command)
    return commands


def test_the_walk_finds_the_examples_and_their_plan_commands():
    names = {path.name for path in EXAMPLES}
    assert {"grpo-tiny.yaml", "rljob-tiny.yaml", "grpo-qwen2.5-32b-paper.yaml"} <= names
    assert {path.name for path in EXAMPLES if _header_plan_commands(path)} >= {
        "grpo-qwen2.5-7b-paper.yaml",
        "grpo-qwen2.5-32b-paper.yaml",
    }


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
    assert captured.out.startswith("ok: ") and len(captured.out.splitlines()) == 1


@pytest.mark.parametrize("command", [command for path in EXAMPLES for command in _header_plan_commands(path)])
def test_every_plan_command_in_a_header_passes_as_written(command, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the headers name examples/ from the repository root
    code = main(shlex.split(command)[1:])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.strip().splitlines()[-1].startswith("OK fits")
