"""Render the RLJob reference (docs/rljob-reference.md) from the operator's models and constants.

The page is generated, never hand-edited, so it cannot drift from what the CRD and the operator
accept; tests/unit/operator/test_rljob_reference.py fails when the checked-in file is stale.
Regenerate with `make crd` (python -m rldock.operator.rljob_reference > docs/rljob-reference.md).
"""

from __future__ import annotations

import enum
import json
import sys
import types
import typing
from datetime import datetime
from typing import Any

from pydantic import BaseModel
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rldock.config import JobConfig
from rldock.config.config_reference import constraints_text
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.constants import (
    API_VERSION,
    CRD_NAME,
    FINALIZER,
    KIND,
    SHORT_NAMES,
    ConditionType,
    EventReason,
    Phase,
    Reason,
)
from rldock.operator.crd import PRINTER_COLUMNS


def _anchor(path: str) -> str:
    return path.replace(".", "").replace("[]", "").lower()


def _type_name(annotation: Any, nested: list[tuple[str, type[BaseModel]]], path: str) -> str:
    """Markdown for a field's type; models met on the way are queued in `nested` for own sections."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is JobConfig:
        return "[job config](config-reference.md)"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        nested.append((path, annotation))
        return f"object, see [`{path}`](#{_anchor(path)})"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f"`{member.value}`" for member in annotation)
    if annotation is datetime:
        return "timestamp"
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0], nested, path)
    if origin in (typing.Union, types.UnionType):  # Optional[int] and `int | None` alike
        branches = [a for a in args if a is not type(None)]
        names = sorted({_type_name(a, nested, path) for a in branches})
        if names == ["integer", "string"]:  # resource.Quantity
            return 'quantity (e.g. `4`, `"500m"`, `"64Gi"`)'
        return " or ".join(names)
    if origin is list:
        return f"list of {_type_name(args[0], nested, path + '[]')}"
    if origin is dict:
        return f"map of {_type_name(args[0], nested, path)} to {_type_name(args[1], nested, path)}"
    return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(
        getattr(annotation, "__name__", ""), str(annotation)
    )


def _defaults_of(model: type[BaseModel]) -> BaseModel | None:
    """The model with every field at its default, or None when some field is required."""
    try:
        return model()
    except ValueError:
        return None


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]  # the operator's factories take no data
        if isinstance(value, BaseModel):
            if _defaults_of(type(value)) == value:
                return "(section defaults)"
            value = value.model_dump(by_alias=True, mode="json")
        return f"`{json.dumps(value)}`"
    if info.default is PydanticUndefined:
        return "**required**"
    if info.default is None:
        return "unset"
    value = info.default.value if isinstance(info.default, enum.Enum) else info.default
    return f"`{json.dumps(value)}`"


def _section(model: type[BaseModel], path: str, out: list[str]) -> None:
    nested: list[tuple[str, type[BaseModel]]] = []
    out += [f"## `{path}`", ""]
    if model.__doc__ and model not in (RLJobSpec, RLJobStatus) and not model.__doc__.startswith("camelCase"):
        out += [" ".join(model.__doc__.split()), ""]
    out += ["| field | type | default | constraints | description |", "| --- | --- | --- | --- | --- |"]
    for name, info in model.model_fields.items():
        wire = info.alias or to_camel(name)
        type_name = _type_name(info.annotation, nested, f"{path}.{wire}")
        description = (info.description or "").replace("|", "\\|")
        out.append(f"| `{wire}` | {type_name} | {_default(info)} | {constraints_text(info)} | {description} |")
    out.append("")
    for sub_path, sub_model in nested:
        _section(sub_model, sub_path, out)


def render() -> str:
    out = [
        "# RLJob reference",
        "",
        "Generated from `operator/src/rldock/operator/api.py` and `operator/src/rldock/operator/constants.py` by "
        "`python -m rldock.operator.rljob_reference`; do not edit. How the operator acts on each field is in "
        "[operator.md](operator.md); what to do about each condition reason and Event is in "
        "[troubleshooting.md](troubleshooting.md).",
        "",
        f"`apiVersion: {API_VERSION}`, `kind: {KIND}` (CRD `{CRD_NAME}`, short name "
        f"{', '.join(f'`{s}`' for s in SHORT_NAMES)}), namespaced, with a status subresource. Unknown "
        "fields are refused only where the client asks for strict field validation: `kubectl` 1.25 and "
        "later does by default (server-side `fieldValidation=Strict`; older `kubectl` checks the published "
        'schema itself), so `kubectl apply`/`create` fail with `unknown field "spec.foo"`. Other clients '
        "(the Python or Go client, Helm, `kubectl --validate=false`) get the API server's default, which "
        "accepts the object and silently drops (prunes) the unknown fields, with at most a warning: the "
        "operator never sees them and cannot refuse them. Check a spec written by such a client with "
        "`kubectl apply --dry-run=server --validate=strict -f rljob.yaml`. "
        "Rules across fields are checked by the operator, which reports them as "
        f"condition `SpecValid=False`. The operator adds the finalizer `{FINALIZER}`.",
        "",
        "`kubectl get rljobs` columns:",
        "",
        "| column | from | meaning |",
        "| --- | --- | --- |",
    ]
    for column in PRINTER_COLUMNS:
        wide = " (`-o wide`)" if column.get("priority") else ""
        out.append(f"| {column['name']}{wide} | `{column['jsonPath']}` | {column.get('description', '')} |")
    out.append("")
    _section(RLJobSpec, "spec", out)
    _section(RLJobStatus, "status", out)
    out += [
        "## Values",
        "",
        "| what | values |",
        "| --- | --- |",
        f"| `status.phase` | {', '.join(f'`{p.value}`' for p in Phase)} |",
        f"| condition `type` | {', '.join(f'`{c.value}`' for c in ConditionType)} |",
        f"| condition `reason` | {', '.join(f'`{r.value}`' for r in Reason)} |",
        f"| Event `reason` | {', '.join(f'`{r.value}`' for r in EventReason)} |",
        "",
    ]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
