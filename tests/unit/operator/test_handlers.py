"""The kopf wiring: settings, registered handlers, the status merge patch."""

from __future__ import annotations

import kopf

from rldock.operator.handlers import configure_kopf, register, status_patch
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
