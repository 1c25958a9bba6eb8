"""The kopf handlers: thin wiring from RLJob events to the reconciler (reconcile.py).

- a timer per RLJob, every `poll_interval` (<= 5 s) seconds: one reconcile round (level-based:
  each round reads the world and moves it one step towards the spec), then the status patch (only
  when it changed) and the round's Events. Creation, spec edits, suspend and TTL all go through
  it; there are no create/update handlers whose missed events could leave an RLJob behind. The
  round writes the status itself (Reconciler.write_status), not through kopf's patch, so a
  status the API server refuses becomes a condition instead of ending the timer.
- a deletion handler behind the finalizer `rldock.io/cleanup`: stop the Ray job; the children go
  by owner references (garbage collector). It is best effort and never raises, so the finalizer
  comes off whatever the cluster answers; nothing in it writes the status.

Kopf keeps its own bookkeeping in annotations, not in `status.kopf`: the RLJob's status schema is
structural and the API server would prune it. Annotations that do not parse (someone edited them)
count as absent and are rewritten (bookkeeping.py), rather than failing every event of the RLJob. An invalid spec is not a kopf.PermanentError: the
round writes phase Failed once, and later rounds find nothing to change (no hot loop, no patch).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

import kopf
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from rldock.operator.constants import FINALIZER, GROUP, PLURAL, VERSION, EventReason
from rldock.operator.bookkeeping import TolerantDiffBaseStorage, TolerantProgressStorage
from rldock.operator.reconcile import Reconciler
from rldock.operator.settings import OperatorSettings
from rldock.operator.status import status_changed

HANDLER_ID = "reconcile"


def configure_kopf(settings: kopf.OperatorSettings, ours: OperatorSettings) -> kopf.OperatorSettings:
    """Kopf's settings for the rldock operator."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = TolerantProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = TolerantDiffBaseStorage(prefix=GROUP, key="last-handled-configuration")
    # No watching of CRDs and namespaces (which would need cluster-wide RBAC): the RLJob CRD must
    # exist when the operator starts (__main__ checks) and namespaces are named, or all of them.
    settings.scanning.disabled = True
    settings.posting.reporting_component = "rldock-operator"
    # A round in progress when the RLJob is deleted (a sync timer cannot be cancelled) is checked
    # again after this long, not kopf's default 60 s, before the finalizer comes off.
    settings.background.cancellation_polling = ours.poll_interval
    # Watch streams are re-opened now and then, so a silently dropped connection heals itself.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    return settings


def _plain(body: kopf.Body) -> dict[str, Any]:
    return {key: copy.deepcopy(value) for key, value in body.items()}


def reconcile(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    """One round. Never raises for the API server's answers: an exception would end kopf's timer
    of this RLJob for good (kopf does not restart a timer that raised), leaving it unreconciled."""
    reconciler: Reconciler = memo["reconciler"]
    raw = _plain(body)
    try:
        outcome = reconciler.reconcile(raw)
        events = list(outcome.events)
        if outcome.status is not None and status_changed(raw.get("status"), outcome.status):
            events += reconciler.write_status(raw, outcome.status)
    except ApiException as error:  # the API server will answer again next round
        logger.warning("Kubernetes API error, retrying next round: %s %s", error.status, error.reason)
        return
    except HTTPError as error:  # no answer at all
        logger.warning("Kubernetes API unreachable, retrying next round: %s", error)
        return
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason.value, message=event.message)


def cleanup(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    reconciler: Reconciler = memo["reconciler"]
    try:
        stopped = reconciler.stop_for_deletion(_plain(body))
    except ApiException as error:  # the cluster goes with the RLJob anyway (owner references)
        logger.warning("could not look for a Ray job to stop (%s %s); deleting anyway", error.status, error.reason)
        return
    except HTTPError as error:
        logger.warning("Kubernetes API unreachable (%s); deleting anyway", error)
        return
    if stopped is not None:
        kopf.event(body, type="Normal", reason=EventReason.STOPPED_RAY_JOB.value,
                   message=f"stopped Ray job {stopped}: the RLJob is deleted")
        logger.info("stopped Ray job %s", stopped)


def register(registry: kopf.OperatorRegistry, settings: OperatorSettings) -> kopf.OperatorRegistry:
    """Put the handlers in `registry`, with the poll interval of `settings`."""
    # Kopf authenticates as the kubernetes client does: in-cluster service account or $KUBECONFIG.
    kopf.on.login(registry=registry)(kopf.login_via_client)
    # backoff: a round that raised (a bug, or the API server away) is retried at the poll pace,
    # not kopf's default 60 s, so the status never lags longer than needed.
    kopf.timer(GROUP, VERSION, PLURAL, id=HANDLER_ID, registry=registry, interval=settings.poll_interval,
               initial_delay=0, backoff=settings.poll_interval)(reconcile)
    kopf.on.delete(GROUP, VERSION, PLURAL, id="cleanup", registry=registry,
                   retries=3, backoff=settings.poll_interval)(cleanup)
    return registry
