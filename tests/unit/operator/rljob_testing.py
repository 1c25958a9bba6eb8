"""Shared test data and schema helpers for the operator's unit tests (imported, not a conftest)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from typing import Any

import jsonschema
import yaml

from rldock.operator.facts import RoundFacts
from rldock.operator.rules import classify
from rldock.operator.status import compute_status, parse_status
from rldock_e2e.repo import kuberay_crd_dir, require_kuberay_crds

KUBERAY_RAYCLUSTER_CRD = kuberay_crd_dir() / "ray.io_rayclusters.yaml"
KUBERNETES_VERSION = "1.30"


def job_dict() -> dict[str, Any]:
    """A small valid runtime job config (G*N = 32 samples over DP 2, 2 nodes x 8 devices)."""
    return {
        "name": "grpo-test",
        "iterations": 40,
        "model": {"path": "/models/tiny", "builder": "tiny-qwen2"},
        "algorithm": {
            "num_prompts_per_iteration": 8,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 3e-4,
        },
        "training": {"data_parallel_size": 2},
        "resources": {"num_nodes": 2, "devices_per_node": 8},
    }


def spec_dict(**sections: Any) -> dict[str, Any]:
    """A valid RLJob spec (camelCase, as kubectl would send it); keyword arguments replace sections."""
    spec: dict[str, Any] = {"job": job_dict(), "checkpoint": {"claimName": "rl-checkpoints"}}
    spec.update(copy.deepcopy(sections))
    return spec


def rljob_object(**sections: Any) -> dict[str, Any]:
    """The RLJob `grpo` in namespace team-a with spec_dict(**sections), as the API server sends it
    to the admission webhook."""
    return {
        "apiVersion": "rldock.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "grpo", "namespace": "team-a"},
        "spec": spec_dict(**sections),
    }


def set_path(data: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of `data` with `a.b.c` set to `value` (or removed when value is DELETE)."""
    data = copy.deepcopy(data)
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
    if value is DELETE:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return data


DELETE = object()


def openapi_to_jsonschema(schema: Any, *, closed: bool = True) -> Any:
    """An OpenAPI v3.0 CRD schema as JSON Schema 2020-12, for `jsonschema` to validate against.

    `nullable` becomes a null type and boolean exclusive bounds become numeric ones. With `closed`,
    objects with listed properties refuse other fields, as the API server does with strict field
    validation (kubectl's default) instead of silently pruning them.
    """
    if isinstance(schema, list):
        return [openapi_to_jsonschema(item, closed=closed) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        key: openapi_to_jsonschema(value, closed=closed) if key in _SUBSCHEMA_KEYS else value
        for key, value in schema.items()
    }
    if "properties" in schema:
        out["properties"] = {
            name: openapi_to_jsonschema(sub, closed=closed) for name, sub in schema["properties"].items()
        }
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if out.get(exclusive) is True:
            out[exclusive] = out.pop(bound)
        elif out.get(exclusive) is False:
            out.pop(exclusive)
    if out.pop("nullable", False):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if (
        closed
        and "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


_SUBSCHEMA_KEYS = {"items", "additionalProperties", "anyOf", "allOf", "oneOf", "not"}


def validator_for(openapi_schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(openapi_to_jsonschema(openapi_schema))


@functools.lru_cache(maxsize=1)
def kuberay_raycluster_validator() -> jsonschema.Draft202012Validator:
    """A validator of KubeRay's real RayCluster CRD schema (ray.io/v1); skips the test (fails it
    under CI) when the CRD is absent."""
    require_kuberay_crds(KUBERAY_RAYCLUSTER_CRD)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD is 17k lines
    crd = yaml.load(KUBERAY_RAYCLUSTER_CRD.read_text(), Loader=loader)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return validator_for(version["schema"]["openAPIV3Schema"])


def error_paths(validator: jsonschema.Draft202012Validator, instance: Any) -> list[str]:
    return [".".join(str(p) for p in error.absolute_path) for error in validator.iter_errors(instance)]


def round_facts(
    *,
    name: str = "grpo",
    now: Any,
    spec: Any = None,
    previous: Mapping[str, Any] | None = None,
    restart_count: int = 0,
    generation: int | None = 1,
    ray_cluster: Mapping[str, Any] | None = None,
    **facts: Any,
) -> RoundFacts:
    """A round's facts after looking at the cluster, as a test states them: `ray_cluster` is the
    RayCluster's KubeRay status (None: no cluster) and `restart_count` the stored status's."""
    return RoundFacts(
        name=name,
        now=now,
        spec=spec,
        previous=parse_status(previous).model_copy(update={"restart_count": restart_count}),
        generation=generation,
        looked=True,
        cluster=None if ray_cluster is None else {"metadata": {}, "spec": {}, "status": ray_cluster},
        **facts,
    )


def status_of(facts: RoundFacts) -> dict[str, Any]:
    """The status a round writes for `facts`, under the rule they classify as."""
    rule = classify(facts)
    assert rule is not None
    return compute_status(facts, rule)
