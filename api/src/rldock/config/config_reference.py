"""Render the job config reference (docs/config-reference.md) from the pydantic models.

The docs are generated, never hand-edited, so they cannot drift from what the loader accepts;
tests/unit/config/test_config_reference.py fails when the checked-in file is stale.
Regenerate with: python -m rldock.config.config_reference > docs/config-reference.md
"""

from __future__ import annotations

import inspect
import re
import sys
import types
import typing

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rldock.config.job import JobConfig
from rldock.config.section import Expanded

_CONSTRAINTS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "min length", "max_length": "max length"}


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):  # Optional[int] and `int | None` alike
        return " or ".join(_type_name(a) for a in typing.get_args(annotation) if a is not type(None))
    return getattr(annotation, "__name__", str(annotation))


def _optional_model(annotation) -> type[BaseModel] | None:
    """The section of an optional section field (`Optional[GeneratorSpec]`), else None."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            return args[0]
    return None


def _list_item_model(annotation) -> type[BaseModel] | None:
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def constraints_text(info: FieldInfo) -> str:
    """A field's numeric and length bounds as `>= 1, < 0.5`, and which expansions a path field takes
    (also used by the RLJob reference)."""
    parts = []
    for meta in info.metadata:
        if isinstance(meta, Expanded):
            parts.append("expands `~` and `$VAR`" if meta.variables else "expands `~`")
        for attr, symbol in _CONSTRAINTS.items():
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{symbol} {value}")
    return ", ".join(parts)


def _row(*cells: str) -> str:
    """One table row; a `|` inside a cell (a default, a description, a type's repr) is escaped, or
    Markdown would read it as a column border and shift the row's cells."""
    return "| " + " | ".join(re.sub(r"(?<!\\)\|", r"\\|", cell) for cell in cells) + " |"


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        return "(section defaults)"
    if info.default is PydanticUndefined:
        return "**required**"
    return f"`{info.default!r}`" if info.default is not None else "unset"


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    out.append(f"## `{prefix or '(top level)'}`\n")
    if model.__doc__ and model is not JobConfig:
        out.append(inspect.cleandoc(model.__doc__) + "\n")  # continuation lines unindented, not code
    out.append("| field | type | default | constraints | description |")
    out.append("| --- | --- | --- | --- | --- |")
    for name, info in model.model_fields.items():
        annotation = info.annotation
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            nested.append((path, annotation))
            out.append(_row(f"`{name}`", "section", _default(info), "", f"see [`{path}`](#{path.replace('.', '')})"))
            continue
        description = info.description or ""
        optional = _optional_model(annotation)
        if optional is not None:  # an optional section, e.g. data.generator: unset unless given
            nested.append((path, optional))
            out.append(
                _row(
                    f"`{name}`",
                    f"optional section, see [`{path}`](#{path.replace('.', '')})",
                    _default(info),
                    "",
                    description,
                )
            )
            continue
        item = _list_item_model(annotation)
        if item is not None:  # a list of sections, e.g. reward.terms: one table for every item
            nested.append((f"{path}[]", item))
            out.append(
                _row(
                    f"`{name}`",
                    f"list of [`{path}[]`](#{path.replace('.', '')})",
                    _default(info),
                    constraints_text(info),
                    description,
                )
            )
            continue
        out.append(_row(f"`{name}`", _type_name(annotation), _default(info), constraints_text(info), description))
    out.append("")
    for path, sub in nested:
        _section(sub, path, out)


def render() -> str:
    out = [
        "# Job config reference",
        "",
        "Generated from the config models (`api/src/rldock/config/`, `JobConfig` in job.py) by "
        "`python -m rldock.config.config_reference`; do not edit.",
        "Unknown fields are errors. Rules across fields (G*N, times agent.max_segments for a harness, divisible "
        "by the DP size, DP not above the devices, ...) are checked beside each section's fields "
        "(`api/src/rldock/config/<section>.py`) and gathered by `find_problems` in "
        "`api/src/rldock/config/problems.py`.",
        "",
        "Path fields say `expands` under constraints: `rldock validate`, `train` and `plan` expand a leading "
        "`~` (`~user`) in them, and in those that say `$VAR` also `$NAME` and `${NAME}` anywhere (`$$` for a "
        "literal `$`; a variable that is not set is an error naming the field, left as written by `plan`), "
        "once, as they load the config (`api/src/rldock/config/paths.py`); `validate --no-path-checks`, for a "
        "config that runs elsewhere, expands nothing (its `--print` shows what the other machine reads); "
        "a command's arguments keep their `$` for the program. In an "
        "RLJob the pod's runtime expands them with the pod's HOME and environment (`spec.env`); the operator "
        "passes them on as written. `config.json` in the output holds the expanded paths.",
        "",
    ]
    _section(JobConfig, "", out)
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
