"""Asking the API server whether a user may `get` an object: the admission webhook's one API call.

A LocalSubjectAccessReview (authorization.k8s.io/v1) in the RLJob's namespace, carrying the
request's user, uid, groups and extra exactly as the AdmissionReview gave them; the API server
answers with the cluster's own authorizers (RBAC, and any webhook authorizer), so nothing of RBAC
is re-implemented here. The local (namespaced) form, not the cluster-wide SubjectAccessReview: the
operator's per-namespace Role can grant it (rbac.py), and the operator can ask only about the
namespaces it serves.

`build_access_review` is pure; `AccessReviewer` makes the calls, all of one admission request
under one deadline that ends before the API server gives up on the webhook, and turns every way a
call can fail into AccessReviewFailed, which the webhook answers with a refusal (fail closed).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, cast

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rldock.operator.kube import api_message
from rldock.operator.references import VERB, AccessReviewFailed, MayGet, Resource, User

log = logging.getLogger(__name__)

API_VERSION = "authorization.k8s.io/v1"
KIND = "LocalSubjectAccessReview"
# The webhook's timeoutSeconds is 10 (the chart, admission.REQUEST_DEADLINE_S), counted from the API
# server's side: the reviews of one request get 6 s together, leaving time for the request's own
# transfer and the answer.
REVIEW_BUDGET_S = 6.0


def build_access_review(user: User, *, namespace: str, resource: Resource, name: str) -> dict[str, Any]:
    """The LocalSubjectAccessReview asking whether `user` may get `resource` `name` in `namespace`."""
    spec: dict[str, Any] = {
        "user": user.name,
        "groups": list(user.groups),
        "resourceAttributes": {"namespace": namespace, "verb": VERB, "group": "", "resource": resource, "name": name},
    }
    if user.uid:
        spec["uid"] = user.uid
    if user.extra:
        spec["extra"] = {key: list(values) for key, values in user.extra.items()}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"namespace": namespace}, "spec": spec}


class AccessReviewer:
    """Makes the reviews on `api` (the operator's own client: its role needs `create` on
    localsubjectaccessreviews)."""

    def __init__(self, api: client.ApiClient, *, budget_s: float = REVIEW_BUDGET_S) -> None:
        # Any: the client's stubs want its model; a dict in and raw JSON out, as kube.py does.
        self._api = cast(Any, client.AuthorizationV1Api(api))
        self._budget_s = budget_s

    def __call__(self, user: User, namespace: str) -> MayGet:
        """The `may_get` of one admission request: its calls share one deadline from now."""
        deadline = time.monotonic() + self._budget_s

        def may_get(resource: Resource, name: str) -> bool:
            what = f"whether user {json.dumps(user.name)} may {VERB} {resource} {json.dumps(name)}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AccessReviewFailed(f"{what}: no answer within {self._budget_s:g} s")
            body = build_access_review(user, namespace=namespace, resource=resource, name=name)
            try:
                response = self._api.create_namespaced_local_subject_access_review(
                    namespace, body, _request_timeout=remaining, _preload_content=False
                )
                answer = json.loads(response.data)
            except ApiException as error:
                raise AccessReviewFailed(
                    f"{what}: the API server answered HTTP {error.status}: {api_message(error)}"
                ) from error
            except (urllib3.exceptions.HTTPError, OSError) as error:  # timeouts and connection failures
                raise AccessReviewFailed(f"{what}: {type(error).__name__}: {error}") from error
            except ValueError as error:  # not JSON
                raise AccessReviewFailed(f"{what}: the API server's answer is not JSON ({error})") from error
            status = answer.get("status") if isinstance(answer, dict) else None
            allowed = isinstance(status, dict) and status.get("allowed") is True
            log.debug("access review: %s in %s: %s", what, namespace, allowed)
            return allowed

        return may_get
