"""What every child of an RLJob carries: identity, labels and the owner reference."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rldock.operator import naming
from rldock.operator.constants import (
    API_VERSION,
    APP_NAME,
    KIND,
    LABEL_APP_NAME,
    LABEL_MANAGED_BY,
    LABEL_RLJOB,
    MANAGED_BY,
)


@dataclass(frozen=True)
class RLJobRef:
    """The identity of one RLJob object, which the children's names and owner references need."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> RLJobRef:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])


def child_labels(job: RLJobRef) -> dict[str, str]:
    """Labels on every child; `rldock.io/rljob` is what the handlers select children by."""
    return {LABEL_APP_NAME: APP_NAME, LABEL_MANAGED_BY: MANAGED_BY, LABEL_RLJOB: naming.label_value(job.name)}


def owner_reference(job: RLJobRef) -> dict[str, Any]:
    """Makes the RLJob the controller of a child, so deleting it garbage-collects the child."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(
    job: RLJobRef, name: str, *, labels: Mapping[str, str] | None = None, annotations: Mapping[str, str] | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": job.namespace,
        "labels": {**child_labels(job), **(labels or {})},
        "ownerReferences": [owner_reference(job)],
    }
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def put_back(field: str) -> Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any] | None]:
    """The patch of a stored child whose top-level `field` differs from the built one (edited by hand,
    made by an older operator, or the spec moved): that field as built; None while it matches."""

    def patch(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
        return {field: desired[field]} if existing.get(field) != desired[field] else None

    return patch
