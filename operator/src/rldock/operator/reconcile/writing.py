"""Writing a round's status: the operator patches the status subresource itself (write_status says why)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from rldock.operator.builders import RLJobRef
from rldock.operator.kube import Kube, StatusRejected
from rldock.operator.status import Event, rejected_status, status_events, status_patch

log = logging.getLogger(__name__)


def write_status(kube: Kube, body: Mapping[str, Any], new: Mapping[str, Any], *, now: datetime) -> list[Event]:
    """Patch the status subresource to `new`; the Events the write itself calls for.

    The operator writes the status itself rather than through kopf's patch: a status the API
    server refuses (too large, or not matching an older CRD) would otherwise fail after every
    round, and the RLJob would show nothing. A refused status is replaced by a short one whose
    SpecValid condition says why, so the RLJob shows the problem instead of hanging.
    """
    ref = RLJobRef.from_body(body)
    old = dict(body.get("status") or {})
    try:
        kube.patch_rljob_status(ref.namespace, ref.name, status_patch(old, new))
        return []
    except StatusRejected as error:
        message = f"the API server refused the RLJob's status ({error}); shorten the spec's values"
        log.warning("%s/%s: %s", ref.namespace, ref.name, message)
    fallback = rejected_status(previous=old, message=message, generation=body["metadata"].get("generation"), now=now)
    try:
        kube.patch_rljob_status(ref.namespace, ref.name, status_patch(old, fallback))
    except StatusRejected as error:  # e.g. an older CRD without these reasons: nothing to write
        log.error(
            "%s/%s: the short status was refused too (%s); install the CRD of this operator's release",
            ref.namespace,
            ref.name,
            error,
        )
        return []
    return status_events(old, fallback)
