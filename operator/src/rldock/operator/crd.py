"""Generate the RLJob CustomResourceDefinition from the pydantic models in api.py.

The API server wants a *structural* OpenAPI v3 schema, which pydantic's JSON Schema is not: it
uses `$ref`s, `anyOf [X, null]` for Optional, `anyOf [int, str]` for quantities, `const`, numeric
`exclusiveMinimum`, and `additionalProperties: false` (unknown fields are pruned by the API
server instead, and refused by kubectl's strict field validation). `openapi_schema` rewrites it
node by node and `structural_errors` checks the result, so a model change that the API server
would refuse fails here, at generation.
The output also suits a Kubernetes 1.20 API server: no CEL rules and no defaults at all (the models
apply their own defaults when the operator parses a spec, so they live in one place; descriptions
say what they are).

Regenerate the checked-in copy with: python -m rldock.operator.crd > crds/rljobs.rldock.io.yaml
(tests/unit/operator/test_crd.py fails when it is stale).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml
from pydantic import BaseModel

from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.constants import CRD_NAME, GROUP, KIND, LIST_KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION

Schema = dict[str, Any]

# Keywords a structural schema may carry here; anything else pydantic emits is dropped or rewritten.
_KEPT = (
    "description",
    "type",
    "format",
    "enum",
    "pattern",
    "minLength",
    "maxLength",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minItems",
    "maxItems",
    "minProperties",  # bounds of a map's entries (a tool's options)
    "maxProperties",
    "required",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
)
_ALLOWED = frozenset(_KEPT) | {
    "properties",
    "items",
    "additionalProperties",
    "nullable",
    "anyOf",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
}
_INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {
        "name": "Iteration",
        "type": "string",
        "jsonPath": ".status.progress",
        "description": "Finished RL iterations / iterations of the job",
    },
    {
        "name": "Reward",
        "type": "number",
        "jsonPath": ".status.reward",
        "description": "Mean reward of the last iteration (DPO: preference accuracy)",
    },
    {
        "name": "TPS",
        "type": "number",
        "jsonPath": ".status.tokensPerSecondPerDevice",
        "description": "Tokens per second per device in the last iteration",
    },
    {
        "name": "Envs",
        "type": "string",
        "jsonPath": ".status.environmentsReady",
        "description": "Ready / wanted pods of the job's environments (spec.environments), summed",
    },
    {
        "name": "Agents",
        "type": "string",
        "jsonPath": ".status.agentsReady",
        "description": "Ready / wanted pods of the job's agents (spec.agents), summed",
    },
    {
        "name": "Val-Reward",
        "type": "number",
        "jsonPath": ".status.lastEvaluation.reward",
        "priority": 1,
        "description": "Mean reward on the held-out prompts at the last evaluation",
    },
    {
        "name": "Val-Acc",
        "type": "number",
        "jsonPath": ".status.lastEvaluation.accuracy",
        "priority": 1,
        "description": "Share of correct held-out responses at the last evaluation",
    },
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def openapi_schema(model: type[BaseModel]) -> Schema:
    """The model's validation schema as a structural OpenAPI v3 schema (all `$ref`s inlined)."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _convert(raw, defs, model.__name__)


def _convert(node: Schema, defs: dict[str, Schema], path: str) -> Schema:
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        # Keywords beside the $ref (the field's own description, default) override the target's.
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    if "anyOf" in node:
        return _convert_union(node, defs, path)

    out: Schema = {k: node[k] for k in _KEPT if k in node}
    if "const" in node:
        out["enum"] = [node["const"]]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(node.get(exclusive), (int, float)) and not isinstance(node[exclusive], bool):
            # JSON Schema 2020-12 puts the bound in exclusiveMinimum; OpenAPI v3.0 wants a flag.
            out[bound], out[exclusive] = node[exclusive], True
    if "default" in node and isinstance(node["default"], (str, int, float, bool)):
        text = f"Default: `{node['default']}`." if node["default"] != "" else "Default: empty."
        out["description"] = f"{out['description']} {text}" if out.get("description") else text
    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {name: _convert(sub, defs, f"{path}.{name}") for name, sub in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):  # a map such as nodeSelector
        out["additionalProperties"] = _convert(node["additionalProperties"], defs, f"{path}.*")
    if "items" in node:
        out["items"] = _convert(node["items"], defs, f"{path}[]")
    if "type" not in out:
        raise ValueError(f"{path}: no type in the generated schema: {node}")
    return out


def _convert_union(node: Schema, defs: dict[str, Schema], path: str) -> Schema:
    """Optional[X] -> X, not required; int | str -> `x-kubernetes-int-or-string`.

    Optional fields are not marked `nullable`: the API server prunes a null given for a
    non-nullable field, which leaves it unset, exactly what None means to the models; and
    `nullable` beside `enum` is handled differently across API server versions.
    """
    branches = [b for b in node["anyOf"] if b.get("type") != "null"]
    outer = {k: v for k, v in node.items() if k != "anyOf"}
    if len(branches) == 1:
        out = _convert({**branches[0], **outer}, defs, path)
    elif sorted(b.get("type", "") for b in branches) == ["integer", "string"]:
        # Quantities. The branches may carry only their type, so their value checks move up: the
        # string's pattern and maxLength (which apply to strings only) and the integer's minimum
        # (which applies to numbers only), so `cpu: -4` is refused by the API server too.
        out = {"x-kubernetes-int-or-string": True, "anyOf": _INT_OR_STRING}
        out.update({k: b[k] for b in branches if b.get("type") == "string" for k in ("pattern", "maxLength") if k in b})
        out.update({k: b[k] for b in branches if b.get("type") == "integer" for k in ("minimum",) if k in b})
        out.update({k: outer[k] for k in ("description",) if k in outer})
    else:
        raise ValueError(f"{path}: a union of {branches} has no structural schema; use one type")
    return out


def structural_errors(schema: Schema, path: str = "") -> list[str]:
    """What makes `schema` non-structural, or unacceptable to a 1.20 API server (empty if fine)."""
    errors = [f"{path}: keyword {key!r} not allowed" for key in schema if key not in _ALLOWED]
    int_or_string = schema.get("x-kubernetes-int-or-string") is True
    if "type" not in schema and not int_or_string and not schema.get("x-kubernetes-preserve-unknown-fields"):
        errors.append(f"{path}: no type")
    if "anyOf" in schema and not (int_or_string and schema["anyOf"] == _INT_OR_STRING):
        errors.append(f"{path}: anyOf other than int-or-string")
    if "properties" in schema and "additionalProperties" in schema:
        errors.append(f"{path}: both properties and additionalProperties")
    if "additionalProperties" in schema and not isinstance(schema["additionalProperties"], dict):
        errors.append(f"{path}: additionalProperties must be a schema")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in schema and not isinstance(schema[key], bool):
            errors.append(f"{path}: {key} must be a boolean in OpenAPI v3.0")
    for name in schema.get("required", []):
        if name not in schema.get("properties", {}):
            errors.append(f"{path}: required {name!r} is not a property")
    for name, sub in schema.get("properties", {}).items():
        errors += structural_errors(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            errors += structural_errors(schema[key], f"{path}.{key}")
    return errors


def rljob_schema() -> Schema:
    """openAPIV3Schema of the RLJob: spec and status from the models, the object envelope here."""
    status = openapi_schema(RLJobStatus)
    schema = {
        "type": "object",
        "description": "An RL post-training job, run by the rldock operator on a KubeRay RayCluster.",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": openapi_schema(RLJobSpec),
            "status": status,
        },
        "required": ["spec"],
    }
    errors = structural_errors(schema)
    if errors:
        raise ValueError("the RLJob schema is not structural:\n" + "\n".join(errors))
    # Inlined definitions share sub-objects; a copy without sharing keeps YAML free of anchors.
    return json.loads(json.dumps(schema))


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": LIST_KIND,
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["rldock"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": rljob_schema()},
                }
            ],
        },
    }


def render() -> str:
    header = (
        "# Generated from the pydantic models in operator/src/rldock/operator/api.py; do not edit.\n"
        "# Regenerate: python -m rldock.operator.crd > crds/rljobs.rldock.io.yaml\n"
    )
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render())
