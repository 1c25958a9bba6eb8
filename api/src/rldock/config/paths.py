"""The job config's path fields expanded (`~`, `$VARS`) once, where a config is loaded to run here.

`load_job_config` calls `expand_paths`: `rldock validate`, `train` and `plan`, on a laptop and in an
RLJob's pods alike (they load the ConfigMap the operator rendered from `spec.job` as written; the
operator never expands, since its home and environment are not the pods'). Every later reader (the
preflight checks, the trainer, the Ray workers it hands the config to, `config.json` in the output)
sees the expanded text only.

Which fields: those whose annotation carries `Expanded` (config/job.py), found by walking the model
tree (`path_fields`), so a new path field is expanded as soon as it is marked. What:

- `~` and `~user` at the start of a path, a `file.py:name` reference or a command's argument;
- in paths and references (`Expanded.variables`), also `$NAME` and `${NAME}` anywhere, `$$` for a
  literal `$`. A variable that is not set is a problem naming the field; `expand_paths` leaves it
  as written, for `plan`, which reads the model here but starts nothing (`validate --no-path-checks`,
  for a config that runs elsewhere, expands nothing: loading.resolve_job_config).

A command's arguments keep their `$`: the program sees them as written, as it would run without a
shell (a `sh -c` script reads its variables from the environment it inherits).
"""

from __future__ import annotations

import os
import pwd
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from rldock.config.job import JobConfig
from rldock.config.problems import Problem
from rldock.config.section import Expanded

# `$$`, `${NAME}` or `$NAME`; any other `$` (`$5`, a trailing `$`) stays as written.
_VARIABLE = re.compile(r"\$(?:(?P<dollar>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<name>[A-Za-z_][A-Za-z0-9_]*))")


def expand_text(text: str, *, variables: bool, environ: Mapping[str, str]) -> tuple[str, list[str]]:
    """`text` with `~` expanded (and, with `variables`, `$NAME`, `${NAME}` and `$$`), and the names
    of the variables it names that `environ` lacks (left as written)."""
    text = _expand_tilde(text, environ)
    if not variables:
        return text, []
    unset: list[str] = []

    def replace(match: re.Match[str]) -> str:
        if match.group("dollar"):
            return "$"
        name = match.group("braced") or match.group("name")
        if name in environ:
            return environ[name]
        unset.append(name)
        return match.group(0)

    return _VARIABLE.sub(replace, text), unset


def _expand_tilde(text: str, environ: Mapping[str, str]) -> str:
    """`~` or `~/...` with HOME from `environ` (the user database without one), `~user/...` from the
    user database; an unknown user stays as written, as in a shell."""
    if not text.startswith("~"):
        return text
    user, _, _ = text[1:].partition("/")
    if user:
        home = os.path.expanduser(f"~{user}")
        if home.startswith("~"):
            return text
    else:
        home = environ.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir
    return (home.rstrip("/") + text[1 + len(user) :]) or "/"


def expand_paths(cfg: JobConfig, *, environ: Mapping[str, str]) -> tuple[JobConfig, list[Problem]]:
    """`cfg` with every `Expanded` field expanded, and a problem for each variable `environ` lacks
    (the field keeps that variable as written)."""
    problems: list[Problem] = []
    expanded = _expand_model(cfg, "", environ, problems)
    assert isinstance(expanded, JobConfig)
    return expanded, problems


def _expand_model(model: BaseModel, where: str, environ: Mapping[str, str], problems: list[Problem]) -> BaseModel:
    update: dict[str, Any] = {}
    for name, info in type(model).model_fields.items():
        value = getattr(model, name)
        at = f"{where}.{name}" if where else name
        marker = _marker(info.metadata)
        if marker is not None:
            new = _expand_value(value, at, marker, environ, problems)
        elif isinstance(value, BaseModel):
            new = _expand_model(value, at, environ, problems)
        elif isinstance(value, list) and any(isinstance(item, BaseModel) for item in value):
            items = [
                _expand_model(item, f"{at}[{index}]", environ, problems) if isinstance(item, BaseModel) else item
                for index, item in enumerate(value)
            ]
            new = value if all(item is old for item, old in zip(items, value)) else items
        else:
            continue
        if new is not value:
            update[name] = new
    # model_copy, not assignment: the values were validated as written, and a copy keeps the
    # private attributes (JobConfig's ablations) and which fields the user set.
    return model.model_copy(update=update) if update else model


def _expand_value(value: Any, at: str, marker: Expanded, environ: Mapping[str, str], problems: list[Problem]) -> Any:
    if value is None:
        return value
    if isinstance(value, list):
        items = [_expand_value(item, f"{at}[{index}]", marker, environ, problems) for index, item in enumerate(value)]
        return value if items == value else items
    text, unset = expand_text(value, variables=marker.variables, environ=environ)
    problems.extend(
        Problem(
            at,
            f"${name} is not set in this environment; set it (in an RLJob: spec.env) or write the path out "
            "($$ for a literal $)",
        )
        for name in unset
    )
    return value if text == value else text


def _marker(metadata: list[Any]) -> Expanded | None:
    return next((item for item in metadata if isinstance(item, Expanded)), None)


def path_fields(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[tuple[str, Expanded]]:
    """Every `Expanded` field under `model` as (dotted name, marker); a list of sections is written
    `reward.terms[]`. For tests and the reference docs."""
    found: list[tuple[str, Expanded]] = []
    for name, info in model.model_fields.items():
        at = f"{prefix}.{name}" if prefix else name
        marker = _marker(info.metadata)
        if marker is not None:
            found.append((at, marker))
            continue
        for section, in_list in _sections(info.annotation):
            found.extend(path_fields(section, f"{at}[]" if in_list else at))
    return found


def _sections(annotation: Any, *, in_list: bool = False) -> list[tuple[type[BaseModel], bool]]:
    """The config sections inside an annotation (itself, or in Optional or list arguments), each with
    whether it is a list's item."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, in_list)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list):
        return [
            found for arg in typing.get_args(annotation) for found in _sections(arg, in_list=in_list or origin is list)
        ]
    return []
