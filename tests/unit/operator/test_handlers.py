"""The kopf wiring: settings, registered handlers, the status merge patch, and what keeps an RLJob
from wedging: garbage in kopf's annotations, a deletion whose cleanup fails."""

from __future__ import annotations

import logging

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from rldock.operator.bookkeeping import TolerantDiffBaseStorage, TolerantProgressStorage
from rldock.operator.handlers import cleanup, configure_kopf, register
from rldock.operator.status import status_patch
from rldock.operator.settings import OperatorSettings


def test_kopf_keeps_its_state_in_annotations_and_uses_our_finalizer():
    settings = configure_kopf(kopf.OperatorSettings(), OperatorSettings(poll_interval=2))
    assert settings.persistence.finalizer == "rldock.io/cleanup"
    # status.kopf would be pruned by the structural status schema
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.scanning.disabled  # no cluster-wide RBAC for CRDs and namespaces
    assert settings.background.cancellation_polling == 2


def test_one_timer_within_the_status_lag_budget_and_a_deletion_handler():
    registry = register(kopf.OperatorRegistry(), OperatorSettings(poll_interval=3))
    (timer,) = registry._spawning.get_all_handlers()
    assert timer.id == "reconcile" and timer.interval == 3 and timer.backoff == 3 and timer.requires_finalizer
    (deletion,) = registry._changing.get_all_handlers()
    assert deletion.id == "cleanup" and deletion.reason == kopf.Reason.DELETE


def test_status_patch_removes_what_the_new_status_lacks():
    old = {"phase": "Running", "rayJobId": "sid-0", "iteration": 3}
    new = {"phase": "Suspended", "iteration": 3}
    assert status_patch(old, new) == {"phase": "Suspended", "iteration": 3, "rayJobId": None}


# --- garbage in kopf's annotations, and a deletion that must not hang ---------------------------

DIFFBASE = "rldock.io/last-handled-configuration"


def _rljob(annotations: dict) -> kopf.Body:
    return kopf.Body({"metadata": {"name": "grpo", "namespace": "ns", "annotations": annotations}})


@pytest.mark.parametrize("value, expected", [
    ('{"spec": {"suspend": true}}', {"spec": {"suspend": True}}),  # what kopf wrote
    ("{not json", None),  # before: JSONDecodeError on every event; never reconciled, deletion hung
    ('"a string"', None),  # parses, but kopf then calls .get on it
    ("[1, 2]", None),
    ("", None),
])
def test_kopf_annotations_that_do_not_parse_count_as_absent(value, expected):
    storages = configure_kopf(kopf.OperatorSettings(), OperatorSettings()).persistence
    assert isinstance(storages.diffbase_storage, TolerantDiffBaseStorage)
    assert storages.diffbase_storage.fetch(body=_rljob({DIFFBASE: value})) == expected
    assert isinstance(storages.progress_storage, TolerantProgressStorage)
    assert storages.progress_storage.fetch(key="cleanup", body=_rljob({"rldock.io/cleanup": value})) == expected


class _FailingReconciler:
    def stop_for_deletion(self, body):
        raise ApiException(status=500, reason="etcd leader changed")


def test_cleanup_never_raises_so_the_finalizer_comes_off():
    memo = kopf.Memo(reconciler=_FailingReconciler())
    cleanup(body=_rljob({}), memo=memo, logger=logging.getLogger("test"))  # before: raised, retried
