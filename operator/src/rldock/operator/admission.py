"""Admission of RLJobs: a validating webhook that refuses at `kubectl apply` what the operator would
otherwise fail at its first round, and serves it over HTTPS.

`review` is pure: an admission.k8s.io/v1 AdmissionReview and the operator's settings in, the
AdmissionReview with the response out. It refuses a CREATE or UPDATE of an RLJob whose spec is
invalid (validation.parse_spec: reason InvalidSpec) or outside the admin's policy
(policy.policy_problems: reason PolicyDenied), with status code 422 and a message listing every
problem as `path: message`, the same text the RLJob's Failed condition would carry; and an UPDATE
that changes spec.managedBy, which is immutable (Kueue's convention for job resources). And it
refuses, with status code 403 and reason Forbidden, an RLJob naming a Secret, ConfigMap or
PersistentVolumeClaim that the requesting user may not `get` (references.py: on CREATE every one,
on UPDATE those the old object did not name), asking the API server through the injected `access`
(access_review.py); when the API server cannot answer, it refuses too (500), saying so. Everything
else is allowed.

`WebhookServer` serves `review` at POST /validate-rljob in a daemon thread of every replica (the
webhook's Service routes to any ready one, leader or standby), through serving.py. What it reads
comes from whoever can reach the port (the API server, but also any pod, and the review holds a
tenant's object), so each connection is bounded: the body's size, the number of connections served
at once, and one total deadline for the TLS handshake, the headers and the body.

The reconcile checks stay (reconcile/): where no webhook is installed, where the API server let a
request through without it (failurePolicy Ignore), or where the admin tightened the policy after an
RLJob was admitted, the RLJob fails with reason PolicyDenied and nothing is created for it. The
user check has no such second line: only an admission request says who asked (docs/security.md,
"Without the webhook").
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rldock.operator.constants import GROUP, PLURAL, Reason
from rldock.operator.policy import policy_problems
from rldock.operator.reconcile import managed_elsewhere
from rldock.operator.references import (
    AccessReviewFailed,
    MayGet,
    Reference,
    User,
    forbidden_references,
    new_references,
    user_of,
)
from rldock.operator.serving import Bounds, Certificate, Reply, Request, Server
from rldock.operator.settings import OperatorSettings
from rldock.operator.validation import parse_spec

log = logging.getLogger(__name__)

REVIEW_API_VERSION = "admission.k8s.io/v1"
REVIEW_KIND = "AdmissionReview"
WEBHOOK_PATH = "/validate-rljob"
# An RLJob is at most 1.5 MiB (etcd's default object limit, the API server's 3 MiB request limit
# for a write), and an UPDATE's review carries it twice, old and new.
MAX_REVIEW_BYTES = 8 * 1024 * 1024
# The API server gives up after the webhook's timeoutSeconds (the chart's 10): a connection that
# has not sent its whole request by then is closed.
REQUEST_DEADLINE_S = 10.0
MAX_CONNECTIONS = 32  # served at once; more are closed at once (the API server retries)
REFUSED_CODE = 422  # Unprocessable Entity, as the API server's own validation answers
# A reference to an object the user may not read: 403, as the API server answers what RBAC denies.
FORBIDDEN_CODE, FORBIDDEN_REASON = 403, "Forbidden"
# The API server could not say whether the user may read an object: refused all the same.
UNCHECKED_CODE, UNCHECKED_REASON = 500, "InternalError"

_CHECKED_OPERATIONS = ("CREATE", "UPDATE")


class ReviewError(ValueError):
    """The body is not an AdmissionReview request (answered with HTTP 400)."""


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str | None = None  # a Reason value, or FORBIDDEN_REASON/UNCHECKED_REASON, when refused
    message: str | None = None
    code: int = REFUSED_CODE


ALLOWED = Verdict(allowed=True)

# Who answers `may_get` for one request: its user and the RLJob's namespace in, the answer out
# (access_review.AccessReviewer; the unit tests pass doubles).
Access = Callable[[User, str], MayGet]


def review(body: Any, settings: OperatorSettings, access: Access) -> dict[str, Any]:
    """The AdmissionReview answering `body` (an admission.k8s.io/v1 AdmissionReview request)."""
    request = _request(body)
    verdict = decide(request, settings, access)
    response: dict[str, Any] = {"uid": request["uid"], "allowed": verdict.allowed}
    if not verdict.allowed:
        response["status"] = {
            "status": "Failure",
            "code": verdict.code,
            "reason": verdict.reason,
            "message": verdict.message,
        }
    return {"apiVersion": REVIEW_API_VERSION, "kind": REVIEW_KIND, "response": response}


def _request(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping) or body.get("kind") != REVIEW_KIND or body.get("apiVersion") != REVIEW_API_VERSION:
        raise ReviewError(f"expected an {REVIEW_API_VERSION} {REVIEW_KIND}")
    request = body.get("request")
    if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str) or not request["uid"]:
        raise ReviewError("the AdmissionReview has no request with a uid")
    return request


def decide(request: Mapping[str, Any], settings: OperatorSettings, access: Access) -> Verdict:
    """Whether the API server may go on with `request` (an AdmissionReview's request); `access`
    answers whether its user may read an object, and is asked only about objects the RLJob adds."""
    resource = request.get("resource") or {}
    if (
        request.get("operation") not in _CHECKED_OPERATIONS
        or request.get("subResource")
        or (resource.get("group"), resource.get("resource")) != (GROUP, PLURAL)
    ):
        # DELETE, CONNECT, status writes, or a webhook configuration that sends more than RLJobs:
        # none of it is ours to refuse.
        return ALLOWED
    obj = _mapping(request.get("object"), "request.object")
    spec = _mapping(obj.get("spec"), "request.object.spec")
    old_spec: Mapping[str, Any] | None = None
    if request["operation"] == "UPDATE":
        old_spec = _mapping(
            _mapping(request.get("oldObject"), "request.oldObject").get("spec"), "request.oldObject.spec"
        )
        if old_spec.get("managedBy") != spec.get("managedBy"):
            return Verdict(
                False,
                Reason.INVALID_SPEC.value,
                f"spec.managedBy: field is immutable (was {json.dumps(old_spec.get('managedBy'))}, now "
                f"{json.dumps(spec.get('managedBy'))}); set it when the RLJob is created",
            )
        if old_spec == spec:
            # Metadata only: labels, the finalizer the operator removes on deletion, kopf's
            # annotations. Refusing those would stick an RLJob admitted under an older policy
            # (it could not even be deleted); its spec was checked when it was written.
            return ALLOWED
    parsed, problems = parse_spec(spec)
    if problems:
        return Verdict(False, Reason.INVALID_SPEC.value, _message(problems))
    assert parsed is not None, "parse_spec returns a spec when it finds no problem"
    if managed_elsewhere(obj):
        # Another controller (e.g. MultiKueue's dispatcher) runs this RLJob elsewhere: nothing of it
        # runs in this cluster, so this cluster's policy has nothing to guard, and the cluster that
        # runs the copy checks it against its own. Its spec's own rules hold everywhere, so they are
        # checked here too: a mistake is reported at `kubectl apply`, not by a remote Failed status.
        # managedBy being immutable, it cannot be handed back to this operator later to bypass the
        # policy (and the reconcile checks the policy again anyway).
        return ALLOWED
    denied = policy_problems(parsed, settings.policy, default_image=settings.pod_defaults.image)
    if denied:
        return Verdict(False, Reason.POLICY_DENIED.value, _message(denied))
    # An old spec that no longer parses (written under older rules) vouches for nothing: every
    # reference is checked then.
    old_parsed = parse_spec(old_spec)[0] if old_spec is not None else None
    return _references_verdict(request, obj, new_references(parsed, old_parsed), access)


def _references_verdict(
    request: Mapping[str, Any], obj: Mapping[str, Any], added: list[Reference], access: Access
) -> Verdict:
    """Refused when the request's user may not get one of `added`, or when that cannot be known."""
    if not added:
        return ALLOWED
    namespace = request.get("namespace") or _mapping(obj.get("metadata"), "request.object.metadata").get("namespace")
    if not isinstance(namespace, str) or not namespace:
        raise ReviewError("the request names no namespace")
    try:
        user = user_of(request.get("userInfo"))
    except ValueError as error:
        raise ReviewError(str(error)) from None
    try:
        forbidden = forbidden_references(added, user=user, namespace=namespace, may_get=access(user, namespace))
    except AccessReviewFailed as error:
        log.warning("admission webhook: refusing an RLJob in %s unchecked: %s", namespace, error)
        return Verdict(
            False,
            UNCHECKED_REASON,
            f"could not check that the RLJob's author may read the objects it names, so it is not admitted: "
            f"{error}. Try again; if this persists, the cluster admin checks that the operator may create "
            "localsubjectaccessreviews and that the API server answers",
            UNCHECKED_CODE,
        )
    if forbidden:
        return Verdict(False, FORBIDDEN_REASON, _message(forbidden), FORBIDDEN_CODE)
    return ALLOWED


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ReviewError(f"{where} is not an object")
    return value


def _message(problems: list) -> str:
    # As the Failed condition writes them (status.py), so both read the same.
    return "; ".join(str(problem) for problem in problems)


# --- The HTTPS server -------------------------------------------------------------------------

Review = Callable[[Any], dict[str, Any]]


class WebhookServer:
    """POST /validate-rljob over HTTPS on `port` (0: any free port, see `.port`), in a thread
    (serving.py, which also bounds each connection).

    `handle` answers a decoded AdmissionReview (e.g. `functools.partial(review, settings=...)`); a
    ReviewError is answered with 400. The certificate and key are read at start (bad files fail
    it) and again whenever either file changes, so a rotated certificate is served without a restart.
    """

    def __init__(
        self,
        handle: Review,
        *,
        port: int,
        cert_file: str,
        key_file: str,
        host: str = "0.0.0.0",
        max_review_bytes: int = MAX_REVIEW_BYTES,
        deadline_s: float = REQUEST_DEADLINE_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self._server = Server(
            {("POST", WEBHOOK_PATH): functools.partial(_answer, handle)},
            name="rldock-webhook",
            what="admission webhook",
            port=port,
            host=host,
            max_body_bytes=max_review_bytes,
            certificate=Certificate(cert_file, key_file, what="admission webhook"),
            bounds=Bounds(deadline_s=deadline_s, max_connections=max_connections),
            log_requests=True,
        )
        self.port = self._server.port

    def start(self) -> WebhookServer:
        self._server.start()
        log.info("serving the RLJob admission webhook at https://0.0.0.0:%d%s", self.port, WEBHOOK_PATH)
        return self

    def stop(self) -> None:
        self._server.stop()


def _answer(handle: Review, request: Request) -> Reply:
    try:
        answer = handle(json.loads(request.body))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return Reply(400, f"not JSON: {error}\n".encode())
    except ReviewError as error:
        return Reply(400, f"{error}\n".encode())
    return Reply(200, json.dumps(answer).encode(), "application/json")
