"""The cluster docs must match the code they document: the generated RLJob reference is current,
and the troubleshooting page covers every condition reason and Event reason the operator uses."""

from __future__ import annotations

import re
from pathlib import Path

from rldock.operator.api import RLJobSpec
from rldock.operator.constants import EventReason, Reason
from rldock.operator.rljob_reference import render

REPO = Path(__file__).resolve().parents[3]
REFERENCE = REPO / "docs" / "rljob-reference.md"
TROUBLESHOOTING = REPO / "docs" / "troubleshooting.md"


def test_rljob_reference_is_current():
    assert REFERENCE.read_text() == render(), "docs/rljob-reference.md is stale: make crd"


def test_every_spec_field_is_in_the_reference():
    text = REFERENCE.read_text()
    for name, info in RLJobSpec.model_fields.items():
        assert f"| `{info.alias or name}` |" in text, name
    for section in (
        "spec.cluster",
        "spec.cluster.tolerations[]",
        "spec.scheduling",
        "spec.checkpoint",
        "status",
        "status.conditions[]",
    ):
        assert f"## `{section}`" in text, section


def _first_column(text: str, heading: str) -> list[str]:
    """The first cell (a `code` value) of every row of the table under `heading`."""
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([A-Za-z]+)` \|", section, re.MULTILINE)


def test_troubleshooting_covers_every_condition_reason_once():
    rows = _first_column(TROUBLESHOOTING.read_text(), "## Condition reasons")
    assert sorted(rows) == sorted(r.value for r in Reason)


def test_troubleshooting_covers_every_event_reason_once():
    rows = _first_column(TROUBLESHOOTING.read_text(), "## Events")
    assert sorted(rows) == sorted(r.value for r in EventReason)
