"""What the config tests start from: an example job config as a dict, and the field paths of the
problems a config is refused with."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def example(name: str = "grpo-tiny.yaml") -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


def problem_paths(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return [p.path for p in caught.value.problems]


def problem_messages(data: dict, path: str) -> list[str]:
    """The messages of the problems at `path` that a config is refused with."""
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return [p.message for p in caught.value.problems if p.path == path]
