"""The checked-in config reference must match the models it documents."""

from pathlib import Path

from rldock.config.config_reference import render

REFERENCE = Path(__file__).resolve().parents[3] / "docs" / "config-reference.md"


def test_config_reference_is_current():
    assert REFERENCE.read_text() == render(), (
        "docs/config-reference.md is stale: python -m rldock.config.config_reference > docs/config-reference.md")


def test_every_field_is_documented():
    text = render()
    for section in ("algorithm", "dock", "resources", "checkpoint"):
        assert f"## `{section}`" in text
    assert "num_prompts_per_iteration" in text and "**required**" in text
