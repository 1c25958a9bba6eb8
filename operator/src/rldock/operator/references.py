"""The Secrets, ConfigMaps and PersistentVolumeClaims an RLJob names, and which of them its author
may not read.

An RLJob's pods mount what its spec names, and they run as the operator's creation, not the user's:
without a check, whoever may create an RLJob in a namespace reads every Secret there (a legacy
service-account token's included) by mounting it. So the admission webhook (admission.py) asks the
API server, for each object a CREATE names or an UPDATE adds, whether the requesting user may `get`
it, and refuses the RLJob otherwise.

Everything here is pure: `references` lists what a spec names, with the field that names it;
`new_references` keeps those an UPDATE adds; `forbidden_references` turns an injected answer,
`may_get(resource, name)`, into problems naming the field, the user, the verb, the object and the
namespace. The question itself is asked by access_review.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

from rldock.config import Problem
from rldock.operator.api import EnvFromSource, EnvVar, RLJobSpec, Volume

# The resources as RBAC names them, so a refusal reads as `kubectl auth can-i get secrets` would.
SECRETS: Final = "secrets"
CONFIG_MAPS: Final = "configmaps"
CLAIMS: Final = "persistentvolumeclaims"
Resource = Literal["secrets", "configmaps", "persistentvolumeclaims"]
VERB = "get"


@dataclass(frozen=True)
class Reference:
    """One object of the RLJob's namespace that `path` names."""

    resource: Resource
    name: str
    path: str

    @property
    def target(self) -> tuple[Resource, str]:
        return self.resource, self.name


@dataclass(frozen=True)
class User:
    """Who sent the request: the AdmissionReview's userInfo, which a SubjectAccessReview takes back
    unchanged (a user's groups and extra decide its RBAC as much as its name)."""

    name: str
    uid: str | None = None
    groups: tuple[str, ...] = ()
    extra: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


class MayGet(Protocol):
    """Whether the request's user may `get` the object `name` of `resource` in the RLJob's
    namespace. Raises AccessReviewFailed when the API server could not say."""

    def __call__(self, resource: Resource, name: str) -> bool: ...


class AccessReviewFailed(Exception):
    """The API server did not answer whether the user may read an object (refused, failed, late):
    the webhook refuses the RLJob rather than let it through unchecked."""


def user_of(user_info: Any) -> User:
    """The User of an AdmissionReview request's `userInfo`; ValueError when it names none."""
    if not isinstance(user_info, Mapping) or not isinstance(user_info.get("username"), str):
        raise ValueError("the request's userInfo names no user")
    groups = user_info.get("groups") or []
    extra = user_info.get("extra") or {}
    if not isinstance(groups, list) or not isinstance(extra, Mapping):
        raise ValueError("the request's userInfo has malformed groups or extra")
    return User(
        name=user_info["username"],
        uid=user_info.get("uid") or None,
        groups=tuple(str(group) for group in groups),
        extra={str(key): tuple(str(value) for value in values or ()) for key, values in extra.items()},
    )


def references(spec: RLJobSpec) -> list[Reference]:
    """Every Secret, ConfigMap and PersistentVolumeClaim `spec` names, in field order: what the Ray
    pods get (pull secrets, the checkpoint claim, volumes, env, envFrom) and what each environment's
    and agent's pods get (their env; the pull secrets are the same). The admin's own pull secrets,
    policy.podDefaults, are the admin's and not listed. A new field that names such an object goes
    here, through the helper of its type: tests/unit/operator/test_reference_coverage.py walks the
    CRD schema and fails on one that is missing."""
    found = [
        Reference(SECRETS, ref.name, f"spec.imagePullSecrets[{index}].name")
        for index, ref in enumerate(spec.image_pull_secrets)
    ]
    if spec.checkpoint.claim_name is not None:
        found.append(Reference(CLAIMS, spec.checkpoint.claim_name, "spec.checkpoint.claimName"))
    found += _volume_references(spec.volumes, "spec.volumes")
    found += _env_references(spec.env, "spec.env")
    found += _env_from_references(spec.env_from, "spec.envFrom")
    for index, environment in enumerate(spec.environments):
        found += _env_references(environment.env, f"spec.environments[{index}].env")
    for index, agent in enumerate(spec.agents):
        found += _env_references(agent.env, f"spec.agents[{index}].env")
    return found


def _volume_references(volumes: list[Volume], at: str) -> list[Reference]:
    found = []
    for index, volume in enumerate(volumes):
        path = f"{at}[{index}]"
        if volume.persistent_volume_claim is not None:
            claim = volume.persistent_volume_claim.claim_name
            found.append(Reference(CLAIMS, claim, f"{path}.persistentVolumeClaim.claimName"))
        if volume.config_map is not None:
            found.append(Reference(CONFIG_MAPS, volume.config_map.name, f"{path}.configMap.name"))
        if volume.secret is not None:
            found.append(Reference(SECRETS, volume.secret.secret_name, f"{path}.secret.secretName"))
    return found


def _env_references(env: list[EnvVar], at: str) -> list[Reference]:
    found = []
    for index, var in enumerate(env):
        source = var.value_from
        if source is None:
            continue
        path = f"{at}[{index}].valueFrom"
        if source.secret_key_ref is not None:
            found.append(Reference(SECRETS, source.secret_key_ref.name, f"{path}.secretKeyRef.name"))
        if source.config_map_key_ref is not None:
            found.append(Reference(CONFIG_MAPS, source.config_map_key_ref.name, f"{path}.configMapKeyRef.name"))
    return found


def _env_from_references(env_from: list[EnvFromSource], at: str) -> list[Reference]:
    found = []
    for index, source in enumerate(env_from):
        path = f"{at}[{index}]"
        if source.secret_ref is not None:
            found.append(Reference(SECRETS, source.secret_ref.name, f"{path}.secretRef.name"))
        if source.config_map_ref is not None:
            found.append(Reference(CONFIG_MAPS, source.config_map_ref.name, f"{path}.configMapRef.name"))
    return found


def new_references(spec: RLJobSpec, old: RLJobSpec | None) -> list[Reference]:
    """The references of `spec` to objects `old` does not name (all of them without `old`).

    An object is the same whether it moves from one field to another or not: RBAC's `get` is
    on the whole object, so who could mount it before gains nothing by a new field. Comparing by
    object also keeps writes that add nothing (a status or finalizer write, a change of
    `suspend`) from depending on the writer's rights to objects someone else referenced.
    """
    before = {reference.target for reference in references(old)} if old is not None else set()
    return [reference for reference in references(spec) if reference.target not in before]


def forbidden_references(found: list[Reference], *, user: User, namespace: str, may_get: MayGet) -> list[Problem]:
    """A problem for each reference to an object `user` may not `get` in `namespace`, asking
    `may_get` once per object. AccessReviewFailed from `may_get` propagates."""
    answers: dict[tuple[Resource, str], bool] = {}
    problems = []
    for reference in found:
        if reference.target not in answers:
            answers[reference.target] = may_get(reference.resource, reference.name)
        if not answers[reference.target]:
            problems.append(
                Problem(
                    reference.path,
                    f"user {json.dumps(user.name)} may not {VERB} {reference.resource} {json.dumps(reference.name)} "
                    f"in namespace {json.dumps(namespace)} (an RLJob may only use what its author may read: "
                    f"name one you may read, or ask a namespace admin for `{VERB}` on it)",
                )
            )
    return problems
