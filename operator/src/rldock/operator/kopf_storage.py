"""Kopf's bookkeeping in the RLJob's annotations, read so that garbage there cannot wedge an RLJob.

Kopf keeps JSON in annotations (`rldock.io/last-handled-configuration`, and per-handler progress
records). Its own storages `json.loads` them on every event of the object, so an annotation that
someone edited into something unparseable raised on every event: the RLJob was never reconciled
and its deletion hung behind the finalizer. These storages read such a value as absent, which kopf
then rewrites, and log which annotation it was.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import kopf

log = logging.getLogger(__name__)


def _decoded(body: kopf.Body, full_key: str) -> dict[str, Any] | None:
    """The annotation's JSON object, or None when absent, unparseable or not an object."""
    encoded = (body.get("metadata", {}).get("annotations") or {}).get(full_key)
    if encoded is None:
        return None
    try:
        decoded = json.loads(encoded)
    except ValueError:  # json.JSONDecodeError, or text that is not even a str (bytes)
        decoded = None
    if not isinstance(decoded, dict):
        log.warning(
            "annotation %s of %s/%s is not a JSON object; treating it as absent and rewriting it",
            full_key,
            body.get("metadata", {}).get("namespace"),
            body.get("metadata", {}).get("name"),
        )
        return None
    return decoded


class TolerantDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def fetch(self, *, body: kopf.Body) -> Any | None:
        for full_key in self.make_keys(self.key, body=body):
            decoded = _decoded(body, full_key)
            if decoded is not None:
                return decoded
        return None


class TolerantProgressStorage(kopf.AnnotationsProgressStorage):
    def fetch(self, *, key: Any, body: kopf.Body) -> Any | None:
        for full_key in self.make_keys(key, body=body):
            decoded = _decoded(body, full_key)
            if decoded is not None:
                return decoded
        return None
