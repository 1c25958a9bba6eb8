"""Read a JobConfig from YAML and report every problem with the field path to fix."""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from rldock.config.job import JobConfig
from rldock.config.paths import expand_paths
from rldock.config.problem import Problem, field_path
from rldock.config.problems import find_local_problems, find_problems

# How a loader treats the path fields (resolve_job_config says each).
PathExpansion = Literal["here", "if_set", "as_written"]


class ConfigError(ValueError):
    """A job config that must not start; `problems` lists each field to fix."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid job config {source}:\n{lines}")


def _problems_from_validation(error: ValidationError) -> list[Problem]:
    items = error.errors()
    # A misspelt field is an unknown field and, when the field it meant is required, a missing one: the
    # "did you mean" of the first says it all, so the second is left out.
    meant = {(*item["loc"][:-1], close): item["loc"] for item in items if (close := _close_field(item)) is not None}
    problems = []
    for item in items:
        path = field_path(item["loc"]) or "<root>"
        if item["type"] == "extra_forbidden":
            close = _close_field(item)
            hint = f"did you mean {close}? " if close is not None else "check spelling; "
            message = f"unknown field ({hint}see docs/config-reference.md)"
        elif item["type"] == "missing":
            if tuple(item["loc"]) in meant:
                continue
            message = "required field is missing"
        else:
            message = item["msg"]
            if "input" in item and not isinstance(item["input"], (dict, list)):
                message += f" (got {item['input']!r})"
            message += _allowed_values(item)
        problems.append(Problem(path, message))
    return problems


def _close_field(item: Any) -> str | None:
    """For an unknown field, the closest field name of its section (difflib), if one is close."""
    if item["type"] != "extra_forbidden" or not isinstance(item["loc"][-1], str):
        return None
    model = _model_at(item["loc"][:-1])
    if model is None:
        return None
    close = difflib.get_close_matches(item["loc"][-1], list(model.model_fields), n=1, cutoff=0.6)
    return close[0] if close else None


def _allowed_values(item: Any) -> str:
    """ "; allowed values: ..." for a field whose type is (a list of) a Literal, unless the message
    already lists them (pydantic's literal_error does)."""
    if item["type"] == "literal_error":
        return ""
    values = _literals(_annotation_at(item["loc"]))
    if not values:
        return ""
    listed = ", ".join(map(str, values))
    if item["type"] == "list_type":
        example = f"[{values[-1]}]"
        where = field_path(item["loc"])
        return f"; give a list of: {listed} (e.g. {example}; on the command line --set {where}={example})"
    return f"; allowed values: {listed}"


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (itself, or in Optional/list/dict arguments)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((model for arg in get_args(annotation) if (model := _model_in(arg)) is not None), None)


def _annotation_at(loc: tuple[int | str, ...]) -> Any:
    """The annotation of the JobConfig field at a pydantic error location; None where the walk fails."""
    model: type[BaseModel] | None = JobConfig
    annotation: Any = None
    for part in loc:
        if isinstance(part, int):  # a list index: the same element model
            continue
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        annotation = field.annotation
        model = _model_in(annotation)
    return annotation


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    return JobConfig if not loc else _model_in(_annotation_at(loc))


def _literals(annotation: Any) -> list[Any]:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [value for arg in get_args(annotation) for value in _literals(arg)]


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


def resolve_job_config(
    data: Any,
    *,
    source: str = "<config>",
    paths: PathExpansion = "here",
    environ: Mapping[str, str] | None = None,
) -> JobConfig:
    """parse_job_config, then the path fields expanded (`~`, `$VARS`; config/paths.py) with `environ`
    (default: this process's), as `paths` says:
    - "here": a config that runs here, read from a file (load_job_config) or built in code (the
      benchmarks); a `$VAR` that `environ` lacks is a problem;
    - "if_set": what this machine can expand, the rest as written (`rldock plan`, which reads the
      model's config.json here but starts nothing);
    - "as_written": nothing expanded, for a config checked here that runs elsewhere (`rldock validate
      --no-path-checks`: its `--print` shows the config as the other machine will read it)."""
    cfg = parse_job_config(data, source=source)
    if paths == "as_written":
        return cfg
    cfg, unset = expand_paths(cfg, environ=os.environ if environ is None else environ)
    if unset and paths == "here":
        raise ConfigError(source, unset)
    return cfg


def load_job_config(
    path: str | Path,
    *,
    overrides: dict[str, Any] | None = None,
    check_local: bool = True,
    paths: PathExpansion = "here",
    environ: Mapping[str, str] | None = None,
) -> JobConfig:
    """Load YAML, apply dotted overrides ({"algorithm.learning_rate": 0}), validate, and expand the
    path fields as resolve_job_config says. `check_local`: also run find_local_problems (the model
    folder's shape) here."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), [Problem("<file>", "config file not found")]) from None
    except yaml.YAMLError as error:
        raise ConfigError(str(path), [Problem("<file>", f"not valid YAML: {error}")]) from None
    except UnicodeDecodeError as error:
        message = f"not UTF-8 text ({error.reason} at byte {error.start})"
        raise ConfigError(str(path), [Problem("<file>", message)]) from None
    except OSError as error:  # a directory, no permission, an I/O error
        raise ConfigError(str(path), [Problem("<file>", f"cannot be read: {error.strerror}")]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), [Problem("<root>", "expected a mapping of config sections")])
    if data.get("kind") == "RLJob":
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
    cfg = resolve_job_config(data, source=str(path), paths=paths, environ=environ)
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
