"""The checked-in config reference must match the models it documents."""

import re
from pathlib import Path

from rldock.config.config_reference import _row, render

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "config-reference.md"


def test_config_reference_is_current():
    assert REFERENCE.read_text() == render(), (
        "docs/config-reference.md is stale: python -m rldock.config.config_reference > docs/config-reference.md"
    )


def test_every_field_is_documented():
    text = render()
    for section in ("algorithm", "dock", "resources", "checkpoint"):
        assert f"## `{section}`" in text
    assert "num_prompts_per_iteration" in text and "**required**" in text


def _cells(row: str) -> list[str]:
    """A Markdown table row's cells: split on `|` that is not escaped, without the outer borders."""
    return re.split(r"(?<!\\)\|", row.strip())[1:-1]


def test_every_table_row_has_the_headers_number_of_cells():
    # A `|` left unescaped in a cell (a type shown as `int | None`, a description) would split it
    # and shift the rest of the row into the wrong columns.
    header = None
    rows = 0
    for line in render().splitlines():
        if line.startswith("| field |"):
            header = len(_cells(line))
        elif line.startswith("|") and not line.startswith("| ---"):
            assert header is not None, line
            assert len(_cells(line)) == header, f"row has {len(_cells(line))} cells, header {header}: {line}"
            rows += 1
    assert rows > 50


def test_a_pipe_in_a_cell_is_escaped_once():
    assert _row("`int | None`", "a \\| b") == "| `int \\| None` | a \\| b |"
