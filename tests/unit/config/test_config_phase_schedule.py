"""Config rules for resources.phase_schedule: any value in a sync job, `serial` refused with async."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def demo(*, mode: str, schedule: str) -> dict:
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["training"]["mode"] = mode
    data["dock"]["max_staleness"] = 1
    data.setdefault("resources", {})["phase_schedule"] = schedule
    return data


def test_auto_is_the_default():
    assert (
        parse_job_config(yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())).resources.phase_schedule == "auto"
    )


@pytest.mark.parametrize(
    "mode, schedule", [("sync", "serial"), ("sync", "overlap"), ("async", "auto"), ("async", "overlap")]
)
def test_accepted(mode, schedule):
    assert parse_job_config(demo(mode=mode, schedule=schedule)).resources.phase_schedule == schedule


def test_serial_with_async_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as caught:
        parse_job_config(demo(mode="async", schedule="serial"))
    assert [p.path for p in caught.value.problems] == ["resources.phase_schedule"]


def test_an_unknown_value_is_refused():
    with pytest.raises(ConfigError):
        parse_job_config(demo(mode="sync", schedule="sometimes"))
