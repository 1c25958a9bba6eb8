"""Read a JobConfig from YAML and report every problem with the field path to fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rldock.config.job import JobConfig
from rldock.config.problems import Problem, field_path, find_local_problems, find_problems


class ConfigError(ValueError):
    """A job config that must not start; `problems` lists each field to fix."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid job config {source}:\n{lines}")


def _problems_from_validation(error: ValidationError) -> list[Problem]:
    problems = []
    for item in error.errors():
        path = field_path(item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            message = "unknown field (check spelling; see docs/config-reference.md)"
        elif item["type"] == "missing":
            message = "required field is missing"
        else:
            message = item["msg"]
            if "input" in item and not isinstance(item["input"], (dict, list)):
                message += f" (got {item['input']!r})"
        problems.append(Problem(path, message))
    return problems


def parse_job_config(data: Any, *, source: str = "<config>") -> JobConfig:
    """Validate already-parsed data; raises ConfigError with every problem found."""
    if not isinstance(data, dict):
        raise ConfigError(source, [Problem("<root>", "expected a mapping of config sections")])
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(source, _problems_from_validation(error)) from None
    problems = find_problems(cfg)
    if problems:
        raise ConfigError(source, problems)
    return cfg


def load_job_config(
    path: str | Path, *, overrides: dict[str, Any] | None = None, check_local: bool = True
) -> JobConfig:
    """Load YAML, apply dotted overrides ({"algorithm.learning_rate": 0}), validate."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), [Problem("<file>", "config file not found")]) from None
    except yaml.YAMLError as error:
        raise ConfigError(str(path), [Problem("<file>", f"not valid YAML: {error}")]) from None
    if isinstance(data, dict) and data.get("kind") == "RLJob":
        # A manifest, not a job config: without this it fails as "spec: unknown field", which reads
        # as a typo in the job.
        raise ConfigError(
            str(path),
            [
                Problem(
                    "kind",
                    "this is an RLJob manifest; its job config is spec.job: save spec.job as a file of its "
                    "own to check it here, or let the operator's admission check the whole RLJob with "
                    f"`kubectl apply --dry-run=server -f {path}`",
                )
            ],
        )
    for dotted, value in (overrides or {}).items():
        _set_dotted(data, dotted, value)
    cfg = parse_job_config(data, source=str(path))
    if check_local:
        problems = find_local_problems(cfg)
        if problems:
            raise ConfigError(str(path), problems)
    return cfg


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError("<override>", [Problem(dotted, f"{key} is not a section")])
    node[leaf] = value
