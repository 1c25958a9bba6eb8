"""No field of an RLJob names a Secret, ConfigMap or PersistentVolumeClaim unseen by the admission
webhook's access review (references.py).

The RLJob's CRD schema, generated from the models, is walked for every property that names such an
object; for each, a spec that sets that one reference alone must give that one Reference, with its
field. A new field (a volume of the agents' pods, an `envFrom` of the environments') fails here until
`references` lists it. Then the webhook itself refuses a Secret named in an agent's env, and what the
builders hand the pods (Ray, environments, agents) is exactly what `references` lists, besides the
operator's own children.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from rljob_testing import job_dict, rljob_object, spec_dict

from rldock.operator import naming
from rldock.operator.admission import FORBIDDEN_CODE, review
from rldock.operator.api import RLJobSpec
from rldock.operator.builders import RLJobRef, build_agent, build_environment, build_ray_cluster
from rldock.operator.crd import rljob_schema
from rldock.operator.references import CLAIMS, CONFIG_MAPS, SECRETS, Reference, Resource, User, references
from rldock.operator.settings import OperatorSettings

Schema = dict[str, Any]
SPEC_SCHEMA: Schema = rljob_schema()["properties"]["spec"]

# Every property name that names an object of the RLJob's namespace (as core/v1 spells them), with
# the object's resource and where in the property's value its name is: None when the property is the
# name itself, else the field of the object (of each item, for an array) that holds it.
NAMING_PROPERTIES: dict[str, tuple[Resource, str | None]] = {
    "imagePullSecrets": (SECRETS, "name"),
    "secretKeyRef": (SECRETS, "name"),
    "secretRef": (SECRETS, "name"),
    "secret": (SECRETS, "secretName"),
    "secretName": (SECRETS, None),
    "configMapKeyRef": (CONFIG_MAPS, "name"),
    "configMapRef": (CONFIG_MAPS, "name"),
    "configMap": (CONFIG_MAPS, "name"),
    "persistentVolumeClaim": (CLAIMS, "claimName"),
    "claimName": (CLAIMS, None),
}
# What the patterns below take for a reference and is none, by the end of its schema path, with the
# reason. (No admin-owned field is in the schema: policy.podDefaults' pull secrets are the chart's,
# not the RLJob's, and docs/security.md says they are not checked.)
NOT_REFERENCES: dict[tuple[str, ...], str] = {
    ("configMap", "items", "[]", "key"): "a key of the ConfigMap that `configMap.name` names",
    ("secret", "items", "[]", "key"): "a key of the Secret that `secret.secretName` names",
    ("reward", "terms", "[]", "token_env"): "the name of an environment variable (set from a Secret by `env`)",
    ("agents", "[]", "image"): "an image; its description mentions the runner's ConfigMap, the operator's own",
}
# A property name that would name such an object, or a description that says a field does.
_LOOKS_LIKE_A_NAME = re.compile(r"secret|configmap|claim", re.IGNORECASE)
_SAYS_IT_NAMES = re.compile(r"Secret|ConfigMap|PersistentVolumeClaim|RLJob's namespace")

Segments = tuple[str, ...]  # property names, "[]" for an array's items


def _properties(schema: Schema, at: Segments = ()) -> Iterator[tuple[Segments, Schema]]:
    """Every property of `schema` (the arrays' items' and maps' values' included), with its path."""
    for name, sub in (schema.get("properties") or {}).items():
        yield (*at, name), sub
        yield from _properties(sub, (*at, name))
    if isinstance(schema.get("items"), dict):
        yield from _properties(schema["items"], (*at, "[]"))
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _properties(schema["additionalProperties"], (*at, "{}"))
    for branch in schema.get("anyOf") or ():
        yield from _properties(branch, at)


def _schema_at(segments: Segments) -> Schema:
    node = SPEC_SCHEMA
    for segment in segments:
        node = node["items"] if segment == "[]" else node["properties"][segment]
    return node


def _naming_fields() -> dict[Segments, Resource]:
    """The path of every string of the spec that holds the name of a Secret, ConfigMap or PVC."""
    found: dict[Segments, Resource] = {}
    for segments, schema in _properties(SPEC_SCHEMA):
        if segments[-1] not in NAMING_PROPERTIES:
            continue
        resource, name_field = NAMING_PROPERTIES[segments[-1]]
        leaf = segments
        if schema.get("type") == "array":
            leaf += ("[]",)
        if name_field is not None:
            leaf += (name_field,)
        assert _schema_at(leaf).get("type") == "string", f"{_dotted(leaf)} should be the name"
        assert found.setdefault(leaf, resource) == resource, f"{_dotted(leaf)} names two kinds of object"
    return found


def _dotted(segments: Segments, index: str = "[]") -> str:
    return "spec" + "".join(index if segment == "[]" else f".{segment}" for segment in segments)


NAMING_FIELDS = _naming_fields()


def test_the_walk_finds_every_field_that_looks_like_a_reference():
    """The table above is the whole story: no property named like a reference, and no string described
    as an object of the namespace, is outside it unless listed with its reason."""
    looks = {
        segments
        for segments, schema in _properties(SPEC_SCHEMA)
        if _LOOKS_LIKE_A_NAME.search(segments[-1])
        or (schema.get("type") == "string" and _SAYS_IT_NAMES.search(schema.get("description", "")))
    }
    excluded = {end: [s for s in looks if s[-len(end) :] == end] for end in NOT_REFERENCES}
    unexplained = sorted(
        _dotted(segments)
        for segments in looks - set(NAMING_FIELDS) - {s for found in excluded.values() for s in found}
        if segments[-1] not in NAMING_PROPERTIES
    )
    assert unexplained == [], "add each to NAMING_PROPERTIES (and references.py) or NOT_REFERENCES"
    assert all(excluded.values()), f"NOT_REFERENCES lists what the schema no longer has: {excluded}"
    # The walk sees what it should: the pods of each kind (a walk that found nothing would pass below).
    assert {_dotted(segments) for segments in NAMING_FIELDS} >= {
        "spec.imagePullSecrets[].name",
        "spec.checkpoint.claimName",
        "spec.volumes[].secret.secretName",
        "spec.env[].valueFrom.secretKeyRef.name",
        "spec.environments[].env[].valueFrom.configMapKeyRef.name",
        "spec.agents[].env[].valueFrom.secretKeyRef.name",
        "spec.agents[].env[].valueFrom.configMapKeyRef.name",
    }


# --- A spec that names one object, for each field ---------------------------------------------


def _smallest(schema: Schema) -> Any:
    """The smallest value `schema` takes: an object's required fields, an array's fewest items."""
    if schema.get("x-kubernetes-int-or-string"):
        return 1
    kind = schema.get("type")
    if "enum" in schema:
        return schema["enum"][0]
    if kind == "object":
        return {name: _smallest(schema["properties"][name]) for name in schema.get("required", ())}
    if kind == "array":
        return [_smallest(schema["items"]) for _ in range(schema.get("minItems", 0))]
    if kind == "string":
        # A DNS label, a path, a number: the first the field accepts.
        for candidate in ("x", "/x", "1"):
            if re.search(schema.get("pattern", ""), candidate) and len(candidate) >= schema.get("minLength", 0):
                return candidate
        raise AssertionError(f"no candidate string matches {schema}")
    if kind in ("integer", "number"):
        return schema.get("minimum", 1)
    if kind == "boolean":
        return False
    raise AssertionError(f"no smallest value for {schema}")


def _naming(schema: Schema, segments: Segments, name: str) -> Any:
    """The smallest value of `schema` whose field at `segments` is `name` (arrays with one item)."""
    if not segments:
        return name
    head, *rest = segments
    if head == "[]":
        return [_naming(schema["items"], tuple(rest), name)]
    value = _smallest(schema)
    value[head] = _naming(schema["properties"][head], tuple(rest), name)
    return value


def _spec_naming(segments: Segments, name: str) -> RLJobSpec:
    """A valid spec that names only `name`, at `segments` (a hostPath checkpoint names no claim)."""
    raw = spec_dict(checkpoint={"hostPath": "/mnt/rl"})
    raw[segments[0]] = _naming(SPEC_SCHEMA["properties"][segments[0]], segments[1:], name)
    return RLJobSpec.model_validate(raw)


@pytest.mark.parametrize("segments", sorted(NAMING_FIELDS), ids=_dotted)
def test_every_field_that_names_an_object_is_a_reference(segments):
    name = "only-" + "-".join(s.lower() for s in segments if s != "[]")
    spec = _spec_naming(segments, name)
    assert references(spec) == [Reference(NAMING_FIELDS[segments], name, _dotted(segments, "[0]"))]


def test_a_spec_that_names_nothing_has_no_references():
    assert references(RLJobSpec.model_validate(spec_dict(checkpoint={"hostPath": "/mnt/rl"}))) == []


# --- Through the webhook ------------------------------------------------------------------------

SETTINGS = OperatorSettings()
ALICE = {"username": "alice", "groups": ["system:authenticated"]}
CHECKPOINTS = ("persistentvolumeclaims", "rl-checkpoints")  # the claim every spec_dict names
SOLVER = {"name": "solver", "command": ["python", "/app/agent.py"], "env": [{"name": "LOG_LEVEL", "value": "info"}]}
WITH_SECRET = {
    **SOLVER,
    "env": [*SOLVER["env"], {"name": "DB", "valueFrom": {"secretKeyRef": {"name": "db-password", "key": "k"}}}],
}


def _agent_rljob(agent: dict[str, Any]) -> dict[str, Any]:
    job = job_dict()
    job["data"] = {"generator": {"name": "addition"}, "chat_template": "model"}  # an agent job's
    job["reward"] = {"terms": [{"name": "environment"}]}
    return rljob_object(job=job, agents=[agent])


def _answer(operation: str, obj: dict[str, Any], old: dict[str, Any] | None, asked: list) -> dict[str, Any]:
    """The webhook's answer when alice, who may get only the checkpoint claim, sends the request."""

    def access(user: User, namespace: str) -> Any:
        def may_get(resource: str, name: str) -> bool:
            asked.append((resource, name))
            return (resource, name) == CHECKPOINTS

        return may_get

    request = {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "resource": {"group": "rldock.io", "version": "v1alpha1", "resource": "rljobs"},
        "namespace": "team-a",
        "operation": operation,
        "object": obj,
        "oldObject": old,
        "userInfo": ALICE,
    }
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    return review(body, SETTINGS, access)["response"]


def test_an_agent_s_env_may_name_only_a_secret_its_author_may_get():
    expected = (
        'spec.agents[0].env[1].valueFrom.secretKeyRef.name: user "alice" may not get secrets "db-password" '
        'in namespace "team-a"'
    )
    asked: list = []
    created = _answer("CREATE", _agent_rljob(WITH_SECRET), None, asked)
    assert created["allowed"] is False and created["status"]["code"] == FORBIDDEN_CODE == 403
    assert created["status"]["message"].startswith(expected), created["status"]
    assert asked == [CHECKPOINTS, ("secrets", "db-password")]

    asked.clear()
    assert _answer("CREATE", _agent_rljob(SOLVER), None, asked)["allowed"] is True  # the same without it

    asked.clear()
    updated = _answer("UPDATE", _agent_rljob(WITH_SECRET), _agent_rljob(SOLVER), asked)
    assert updated["allowed"] is False and updated["status"]["code"] == 403
    assert updated["status"]["message"].startswith(expected), updated["status"]
    assert asked == [("secrets", "db-password")]  # only what the update adds


# --- What reaches the pods ----------------------------------------------------------------------

JOB = RLJobRef(name="grpo", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")
# The operator's own children that its pods mount: made by it, never an RLJob author's choice.
OPERATOR_OWNED = {
    (CONFIG_MAPS, naming.config_map_name(JOB.name)),
    (CONFIG_MAPS, naming.agent_runner_config_map_name(JOB.name)),
    (SECRETS, naming.auth_secret_name(JOB.name, JOB.uid)),
    (SECRETS, naming.environment_token_secret_name(JOB.name, JOB.uid)),
}
# Where a pod spec names an object: the volume source and its name field; the env source.
_VOLUME_SOURCES = {
    "secret": (SECRETS, "secretName"),
    "configMap": (CONFIG_MAPS, "name"),
    "persistentVolumeClaim": (CLAIMS, "claimName"),
}
_NAMELESS_VOLUMES = {"name", "emptyDir", "hostPath", "nfs"}
_ENV_SOURCES = {
    "secretKeyRef": SECRETS,
    "configMapKeyRef": CONFIG_MAPS,
    "secretRef": SECRETS,
    "configMapRef": CONFIG_MAPS,
}
_NAMELESS_ENV = {"fieldRef", "prefix"}


def _pod_specs(manifest: Any) -> Iterator[Mapping[str, Any]]:
    """Every pod spec in a manifest (a RayCluster's head and workers, a Deployment's template)."""
    if isinstance(manifest, Mapping):
        if "containers" in manifest:
            yield manifest
        for value in manifest.values():
            yield from _pod_specs(value)
    elif isinstance(manifest, list):
        for item in manifest:
            yield from _pod_specs(item)


def _mounted(pod: Mapping[str, Any]) -> set[tuple[str, str]]:
    """The Secrets, ConfigMaps and PVCs a pod spec names; a volume or env source not known here fails."""
    found = {(SECRETS, ref["name"]) for ref in pod.get("imagePullSecrets", ())}
    for volume in pod.get("volumes", ()):
        assert set(volume) <= {*_VOLUME_SOURCES, *_NAMELESS_VOLUMES}, f"a volume source not known here: {volume}"
        found |= {(resource, volume[key][field]) for key, (resource, field) in _VOLUME_SOURCES.items() if key in volume}
    for container in [*pod["containers"], *pod.get("initContainers", ())]:
        env_sources = [var.get("valueFrom") or {} for var in container.get("env", ())]
        for source in [*env_sources, *container.get("envFrom", ())]:
            assert set(source) <= {*_ENV_SOURCES, *_NAMELESS_ENV}, f"an env source not known here: {source}"
            found |= {(_ENV_SOURCES[key], ref["name"]) for key, ref in source.items() if key in _ENV_SOURCES}
    return found


def test_the_pods_get_exactly_what_references_lists_and_the_operator_s_own():
    env = [
        {"name": "PLAIN", "value": "1"},
        {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "agent-key", "key": "k"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "agent-settings", "key": "mode"}}},
    ]
    spec = RLJobSpec.model_validate(
        spec_dict(
            imagePullSecrets=[{"name": "regcred"}],
            volumes=[
                {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
                {"name": "reward", "configMap": {"name": "reward-code"}},
                {"name": "creds", "secret": {"secretName": "db-password"}},
            ],
            volumeMounts=[{"name": v, "mountPath": f"/{v}"} for v in ("data", "reward", "creds")],
            env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": "reward-token", "key": "t"}}}],
            envFrom=[{"secretRef": {"name": "api-keys"}}, {"configMapRef": {"name": "defaults"}}],
            environments=[
                {
                    "name": "cabinet",
                    "env": [{"name": "E", "valueFrom": {"secretKeyRef": {"name": "env-key", "key": "k"}}}],
                }
            ],
            agents=[{**SOLVER, "env": env}],
        )
    )
    manifests = [
        build_ray_cluster(job=JOB, spec=spec),
        *build_environment(job=JOB, spec=spec, environment=spec.environments[0]),
        *build_agent(job=JOB, spec=spec, agent=spec.agents[0]),
    ]
    pods = [pod for manifest in manifests for pod in _pod_specs(manifest)]
    assert len(pods) == 4  # the head, the workers, the environment's and the agent's
    mounted = set().union(*(_mounted(pod) for pod in pods))
    listed = {reference.target for reference in references(spec)}
    assert not listed & OPERATOR_OWNED
    assert mounted - OPERATOR_OWNED == listed
    assert ("secrets", "agent-key") in listed and ("configmaps", "agent-settings") in listed
