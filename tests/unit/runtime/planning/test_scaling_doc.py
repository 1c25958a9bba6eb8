"""docs/scaling.md pastes `rldock plan`'s output for the paper's configurations: every
`$ rldock plan ...` block there must still print exactly what follows it, so the page cannot drift
from the planner."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from rldock.runtime.cli import main

ROOT = Path(__file__).resolve().parents[4]
BLOCK = re.compile(r"^```\n\$ (rldock plan .*?)\n```$", re.MULTILINE | re.DOTALL)


def plan_blocks() -> list[tuple[str, str]]:
    """(command, printed output) of each `$ rldock plan` block of the page."""
    blocks = []
    for match in BLOCK.finditer((ROOT / "docs" / "scaling.md").read_text()):
        lines = match.group(1).splitlines()
        command = lines.pop(0)
        while command.endswith("\\"):  # a command continued on the next lines
            command = command[:-1] + lines.pop(0)
        blocks.append((command, "\n".join(lines)))
    return blocks


def test_the_page_shows_the_paper_configurations_on_both_device_sizes():
    commands = [command for command, _ in plan_blocks()]
    for model in ("7b", "32b"):
        for memory in ("64GiB", "128GiB"):
            assert any(f"qwen2.5-{model}-paper" in c and f"--device-memory {memory}" in c for c in commands), (
                model,
                memory,
            )


@pytest.mark.parametrize(("command", "printed"), plan_blocks())
def test_each_pasted_plan_is_what_the_planner_prints(command, printed, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the commands name examples/ from the repository root
    code = main(shlex.split(command)[1:])
    assert capsys.readouterr().out.rstrip("\n") == printed
    assert code == (0 if "\nOK fits" in printed else 3)
