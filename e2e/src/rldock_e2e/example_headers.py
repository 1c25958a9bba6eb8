"""The commands an example's header comment tells a user to run, read from the file itself, so the
tests that run them follow the header as written (tests/integration/test_examples_as_written.py,
tests/unit/runtime/test_examples.py).

A header is the comment block at the top of an `examples/*.yaml`. A command in it is either a line
of its own, indented under `#` (`#   rldock data generate ... \\` continued on the next lines), or a
backquoted span in the prose that names a file of examples/ (`` `rldock train examples/x.yaml
--output runs/x` ``; a span like `` `rldock plan` `` names a command, it is none to run). Only
commands of `PROGRAMS` count, a program also by a path to it (a virtualenv's `.../bin/python -m pip
install ...`); the other lines are prose, a variant to add to a command (`--set ...`) or a tool to
look at a run (`tensorboard --logdir ...`), which start nothing of their own.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

PROGRAMS = ("rldock", "kubectl", "python")  # python: `python -m rldock_benchmarks...` experiments
_INLINE = re.compile(r"`((?:" + "|".join(PROGRAMS) + r") [^`]+)`")


def header_lines(path: Path) -> list[str]:
    """The header's lines without their `#`: the comment lines before the first other line."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:])
    return lines


def header_commands(path: Path) -> list[str]:
    """The commands of `path`'s header in order, each as one shell line (continuations joined)."""
    commands, lines = [], header_lines(path)
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        stripped = line.strip()
        if line.startswith("  ") and stripped.split(" ", 1)[0].rsplit("/", 1)[-1] in PROGRAMS:  # a command line
            while stripped.endswith("\\") and index < len(lines):
                stripped = stripped[:-1].rstrip() + " " + lines[index].strip()
                index += 1
            commands.append(stripped)
        else:
            commands.extend(match.group(1) for match in _INLINE.finditer(line) if "examples/" in match.group(1))
    return commands


def argv(command: str) -> list[str]:
    """A header command as the shell would split it (no expansion)."""
    return shlex.split(command)


def program(command: str) -> str:
    """The program a header command runs, by its name (`python` for `~/venv/bin/python -m pip ...`)."""
    return command.split(" ", 1)[0].rsplit("/", 1)[-1]
