"""The config snippets the docs offer a new user validate as printed.

A snippet opts in with a marker comment on the line before its ```yaml fence:
`<!-- validated: no-path-checks -->` (validated with `rldock validate --no-path-checks`: its paths,
such as /models/..., are examples) or `<!-- validated -->` (path checks too). Every marked block
of README.md and docs/**/*.md is validated; the README and docs/bring-your-own.md must mark their
"own model, data and reward" block.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rldock.runtime.cli import main

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKED = re.compile(
    r"^<!-- validated(?P<option>: no-path-checks)? -->\n(?:\s*\n)*```yaml\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL
)


def marked_snippets() -> list[tuple[str, bool, str]]:
    """(where, check paths, YAML) of each marked block."""
    snippets = []
    for page in PAGES:
        text = page.read_text()
        for match in MARKED.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            snippets.append((f"{page.relative_to(ROOT)}:{line}", match.group("option") is None, match.group("body")))
    return snippets


def test_the_own_data_snippets_are_marked():
    where = {location.split(":")[0] for location, _, _ in marked_snippets()}
    assert {"README.md", "docs/bring-your-own.md"} <= where


def test_a_marker_before_something_else_is_not_a_snippet():
    """The marker binds to the very next block only when it is YAML; prose between breaks it."""
    text = "<!-- validated -->\nsome prose\n```yaml\nname: x\n```\n"
    assert MARKED.search(text) is None


@pytest.mark.parametrize(("where", "check_paths", "body"), marked_snippets(), ids=lambda value: str(value)[:40])
def test_each_marked_snippet_validates(where, check_paths, body, tmp_path, capsys):
    config = tmp_path / "snippet.yaml"
    config.write_text(body)
    code = main(["validate", str(config)] + ([] if check_paths else ["--no-path-checks"]))
    captured = capsys.readouterr()
    assert code == 0, f"{where}:\n{captured.err}"
    assert captured.err == "", f"{where} validates with warnings:\n{captured.err}"
