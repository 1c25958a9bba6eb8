"""An RLJob is never a way around RBAC: the objects it names (references.py), the admission
decision on them given an injected answer (admission.decide), the review it sends
(access_review.build_access_review), and the reviewer's calls against an HTTP stand-in for the
API server: its answers, its refusals and its silence all end within the deadline (fail closed).
The same on the real API server: tests/integration/test_operator_rbac_admission.py."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes_validate
import pytest
from kubernetes import client
from rljob_testing import KUBERNETES_VERSION, rljob_object, spec_dict

from rldock.operator.access_review import AccessReviewer, build_access_review
from rldock.operator.admission import (
    FORBIDDEN_CODE,
    UNCHECKED_CODE,
    ReviewError,
    decide,
    review,
)
from rldock.operator.api import RLJobSpec
from rldock.operator.references import (
    AccessReviewFailed,
    Reference,
    User,
    forbidden_references,
    new_references,
    references,
    user_of,
)
from rldock.operator.settings import OperatorSettings

SETTINGS = OperatorSettings()
UID = "705ab4f5-6393-11e8-b7cc-42010a800002"
ALICE = {"username": "alice", "uid": "u-1", "groups": ["team-a", "system:authenticated"], "extra": {"scope": ["x"]}}
OPERATOR = {"username": "system:serviceaccount:rldock-system:rldock", "groups": ["system:serviceaccounts"]}

SECRET_VOLUME = {
    "volumes": [{"name": "creds", "secret": {"secretName": "db-password"}}],
    "volumeMounts": [{"name": "creds", "mountPath": "/creds"}],
}
EVERY_KIND = {
    "imagePullSecrets": [{"name": "regcred"}],
    "volumes": [
        {"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}},
        {"name": "reward", "configMap": {"name": "reward-code"}},
        {"name": "creds", "secret": {"secretName": "db-password"}},
        {"name": "scratch", "emptyDir": {}},
    ],
    "volumeMounts": [
        {"name": "data", "mountPath": "/data"},
        {"name": "reward", "mountPath": "/reward"},
        {"name": "creds", "mountPath": "/creds"},
        {"name": "scratch", "mountPath": "/scratch"},
    ],
    "env": [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "reward-token", "key": "token"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "mode"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "PLAIN", "value": "1"},
    ],
    "envFrom": [{"secretRef": {"name": "api-keys"}}, {"configMapRef": {"name": "defaults"}, "prefix": "D_"}],
    # The environments' pods read what their env names, as the Ray pods do.
    "environments": [
        {
            "name": "cabinet",
            "env": [
                {"name": "PLAIN", "value": "1"},
                {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "env-key", "key": "key"}}},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "env-settings", "key": "mode"}}},
            ],
        }
    ],
}


def spec(**sections: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(spec_dict(**sections))


def request(
    operation: str, obj: dict[str, Any], old: dict[str, Any] | None = None, user: dict[str, Any] = ALICE
) -> dict[str, Any]:
    return {
        "uid": UID,
        "resource": {"group": "rldock.io", "version": "v1alpha1", "resource": "rljobs"},
        "namespace": "team-a",
        "operation": operation,
        "object": obj,
        "oldObject": old,
        "userInfo": user,
    }


class Grants:
    """Test double of access_review.AccessReviewer: the objects each user may get, and every
    question asked."""

    def __init__(self, *readable: tuple[str, str]) -> None:
        self.readable = set(readable)
        self.asked: list[tuple[User, str, str, str]] = []

    def __call__(self, user: User, namespace: str) -> Any:
        def may_get(resource: str, name: str) -> bool:
            self.asked.append((user, namespace, resource, name))
            return (resource, name) in self.readable

        return may_get


CHECKPOINTS = ("persistentvolumeclaims", "rl-checkpoints")  # the claim every spec_dict names


# --- What a spec names ------------------------------------------------------------------------


def test_every_field_that_names_an_object_is_listed_in_field_order():
    assert references(spec(**EVERY_KIND)) == [
        Reference("secrets", "regcred", "spec.imagePullSecrets[0].name"),
        Reference("persistentvolumeclaims", "rl-checkpoints", "spec.checkpoint.claimName"),
        Reference("persistentvolumeclaims", "datasets", "spec.volumes[0].persistentVolumeClaim.claimName"),
        Reference("configmaps", "reward-code", "spec.volumes[1].configMap.name"),
        Reference("secrets", "db-password", "spec.volumes[2].secret.secretName"),
        Reference("secrets", "reward-token", "spec.env[0].valueFrom.secretKeyRef.name"),
        Reference("configmaps", "settings", "spec.env[1].valueFrom.configMapKeyRef.name"),
        Reference("secrets", "api-keys", "spec.envFrom[0].secretRef.name"),
        Reference("configmaps", "defaults", "spec.envFrom[1].configMapRef.name"),
        Reference("secrets", "env-key", "spec.environments[0].env[1].valueFrom.secretKeyRef.name"),
        Reference("configmaps", "env-settings", "spec.environments[0].env[2].valueFrom.configMapKeyRef.name"),
    ]
    # A hostPath checkpoint names no claim; literal and pod-field env values name nothing.
    assert references(spec(checkpoint={"hostPath": "/mnt/rl"})) == []


@pytest.mark.parametrize(
    "old, new, added",
    [
        (None, {}, [CHECKPOINTS]),  # CREATE: everything
        ({}, {}, []),
        ({}, SECRET_VOLUME, [("secrets", "db-password")]),
        (SECRET_VOLUME, SECRET_VOLUME, []),
        # The same Secret moved into another field: RBAC's get is on the object, nothing is gained.
        (SECRET_VOLUME, {"envFrom": [{"secretRef": {"name": "db-password"}}]}, []),
        # A ConfigMap of the same name is another object.
        (SECRET_VOLUME, {"envFrom": [{"configMapRef": {"name": "db-password"}}]}, [("configmaps", "db-password")]),
        (SECRET_VOLUME, {**SECRET_VOLUME, "imagePullSecrets": [{"name": "regcred"}]}, [("secrets", "regcred")]),
        ({}, {"checkpoint": {"claimName": "other"}}, [("persistentvolumeclaims", "other")]),
    ],
)
def test_an_update_checks_only_the_objects_it_adds(old, new, added):
    found = new_references(spec(**new), None if old is None else spec(**old))
    assert [reference.target for reference in found] == added


def test_a_forbidden_reference_names_the_field_user_verb_object_and_namespace():
    grants = Grants(CHECKPOINTS)
    found = references(spec(**SECRET_VOLUME, envFrom=[{"secretRef": {"name": "db-password"}}]))
    problems = forbidden_references(
        found, user=User("alice"), namespace="team-a", may_get=grants(User("alice"), "team-a")
    )
    assert [str(p).split(" (")[0] for p in problems] == [
        'spec.volumes[0].secret.secretName: user "alice" may not get secrets "db-password" in namespace "team-a"',
        'spec.envFrom[0].secretRef.name: user "alice" may not get secrets "db-password" in namespace "team-a"',
    ]
    assert "ask a namespace admin for `get`" in problems[0].message
    assert [asked[2:] for asked in grants.asked] == [CHECKPOINTS, ("secrets", "db-password")]  # once per object


# --- The admission decision -------------------------------------------------------------------


@pytest.mark.parametrize(
    "readable, allowed",
    [
        ({CHECKPOINTS, ("secrets", "db-password")}, True),
        ({CHECKPOINTS}, False),
        ({("secrets", "db-password")}, False),  # the checkpoint claim is a reference too
        (set(), False),
    ],
)
def test_an_rljob_may_name_only_what_its_author_may_read(readable, allowed):
    verdict = decide(request("CREATE", rljob_object(**SECRET_VOLUME)), SETTINGS, Grants(*readable))
    assert verdict.allowed is allowed
    if not allowed:
        assert (verdict.code, verdict.reason) == (FORBIDDEN_CODE, "Forbidden") == (403, "Forbidden")
        assert 'user "alice" may not get' in verdict.message


def test_the_question_carries_the_request_s_user_unchanged():
    grants = Grants(CHECKPOINTS)
    decide(request("CREATE", rljob_object()), SETTINGS, grants)
    ((user, namespace, resource, name),) = grants.asked
    assert user == User("alice", "u-1", ("team-a", "system:authenticated"), {"scope": ("x",)})
    assert (namespace, resource, name) == ("team-a", *CHECKPOINTS)


def test_updates_ask_only_about_added_objects_so_the_operator_s_own_writes_pass():
    old = rljob_object(**SECRET_VOLUME)
    grants = Grants()  # nobody may read anything
    # The operator's finalizer and kopf's annotations (metadata only), as its own service account.
    finalized = {**old, "metadata": {**old["metadata"], "finalizers": ["rldock.io/finalizer"]}}
    assert decide(request("UPDATE", finalized, old, user=OPERATOR), SETTINGS, grants).allowed
    # A spec change that adds no object (suspend) by someone who may read none of them.
    suspended = rljob_object(**SECRET_VOLUME, suspend=True)
    assert decide(request("UPDATE", suspended, old, user=OPERATOR), SETTINGS, grants).allowed
    assert grants.asked == []
    # Adding a Secret is asked about, and only that.
    more = rljob_object(
        **SECRET_VOLUME, env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": "other", "key": "k"}}}]
    )
    verdict = decide(request("UPDATE", more, old), SETTINGS, grants)
    assert not verdict.allowed and "spec.env[0].valueFrom.secretKeyRef.name" in verdict.message
    assert [asked[2:] for asked in grants.asked] == [("secrets", "other")]


def test_an_old_spec_that_no_longer_parses_vouches_for_nothing():
    old = rljob_object(**SECRET_VOLUME)
    old["spec"]["job"] = {"name": "broken"}
    grants = Grants(CHECKPOINTS)
    verdict = decide(request("UPDATE", rljob_object(**SECRET_VOLUME), old), SETTINGS, grants)
    assert not verdict.allowed and "db-password" in verdict.message


def test_the_policy_is_checked_first_and_asks_nothing():
    grants = Grants()
    verdict = decide(request("CREATE", rljob_object(image="docker.io/evil:1", **SECRET_VOLUME)), SETTINGS, grants)
    assert verdict.reason == "PolicyDenied" and grants.asked == []
    elsewhere = rljob_object(managedBy="kueue.x-k8s.io/multikueue", **SECRET_VOLUME)  # nothing of it runs here
    assert decide(request("CREATE", elsewhere), SETTINGS, grants).allowed and grants.asked == []


def test_an_unanswered_question_refuses_the_rljob_object():
    def failing(user: User, namespace: str) -> Any:
        def may_get(resource: str, name: str) -> bool:
            raise AccessReviewFailed(f'whether user "alice" may get {resource} "{name}": HTTP 503: unavailable')

        return may_get

    answer = review(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request("CREATE", rljob_object())},
        SETTINGS,
        failing,
    )["response"]
    assert answer["allowed"] is False and answer["status"]["code"] == UNCHECKED_CODE == 500
    message = answer["status"]["message"]
    assert "could not check" in message and "rl-checkpoints" in message and "HTTP 503" in message, message
    assert "localsubjectaccessreviews" in message


@pytest.mark.parametrize("user_info", [None, {}, {"username": 3}, {"username": "a", "groups": "g"}])
def test_a_request_without_a_user_is_not_a_review(user_info):
    with pytest.raises(ReviewError):
        decide(request("CREATE", rljob_object(), user=user_info), SETTINGS, Grants(CHECKPOINTS))


def test_user_of_reads_every_field():
    assert user_of({"username": "bob"}) == User("bob")
    assert user_of(ALICE).extra == {"scope": ("x",)}


# --- The review and the API call --------------------------------------------------------------


def test_the_review_is_a_valid_local_subject_access_review():
    user = User("alice", "u-1", ("team-a",), {"scope": ("x", "y")})
    body = build_access_review(user, namespace="team-a", resource="secrets", name="db-password")
    kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
    assert body["spec"] == {
        "user": "alice",
        "uid": "u-1",
        "groups": ["team-a"],
        "extra": {"scope": ["x", "y"]},
        "resourceAttributes": {
            "namespace": "team-a",
            "verb": "get",
            "group": "",
            "resource": "secrets",
            "name": "db-password",
        },
    }
    assert "uid" not in build_access_review(User("bob"), namespace="a", resource="configmaps", name="c")["spec"]


class StandIn:
    """An HTTP stand-in for the API server's review endpoint (TEST ONLY): answers `allowed`, or an
    error status, or nothing for `stall_s`."""

    def __init__(self) -> None:
        self.allowed, self.status, self.stall_s = True, 201, 0.0
        self.bodies: list[dict[str, Any]] = []
        self.paths: list[str] = []
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                stand_in.paths.append(self.path)
                stand_in.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                time.sleep(stand_in.stall_s)
                if stand_in.status == 201:
                    answer = {**stand_in.bodies[-1], "status": {"allowed": stand_in.allowed}}
                else:
                    answer = {
                        "kind": "Status",
                        "status": "Failure",
                        "message": "localsubjectaccessreviews is forbidden",
                    }
                data = json.dumps(answer).encode()
                self.send_response(stand_in.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reviewer(self, budget_s: float = 5.0) -> AccessReviewer:
        configuration = client.Configuration(host=f"http://127.0.0.1:{self.server.server_address[1]}")
        return AccessReviewer(client.ApiClient(configuration), budget_s=budget_s)


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn()
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_the_reviewer_asks_in_the_rljob_s_namespace_and_reads_the_answer(stand_in):
    may_get = stand_in.reviewer()(User("alice", groups=("team-a",)), "team-a")
    assert may_get("secrets", "db-password") is True
    stand_in.allowed = False
    assert may_get("secrets", "db-password") is False
    assert stand_in.paths == ["/apis/authorization.k8s.io/v1/namespaces/team-a/localsubjectaccessreviews"] * 2
    assert stand_in.bodies[0] == build_access_review(
        User("alice", groups=("team-a",)), namespace="team-a", resource="secrets", name="db-password"
    )


def test_a_refused_review_fails_closed_with_the_api_server_s_message(stand_in):
    stand_in.status = 403
    may_get = stand_in.reviewer()(User("alice"), "team-a")
    with pytest.raises(
        AccessReviewFailed, match=r'user "alice" may get secrets "s": .*HTTP 403: localsubjectaccessreviews'
    ):
        may_get("secrets", "s")


def test_a_silent_api_server_fails_closed_within_the_deadline(stand_in):
    stand_in.stall_s = 3.0
    may_get = stand_in.reviewer(budget_s=0.5)(User("alice"), "team-a")
    started = time.monotonic()
    with pytest.raises(AccessReviewFailed):
        may_get("secrets", "s")
    with pytest.raises(AccessReviewFailed, match="no answer within 0.5 s"):
        may_get("secrets", "t")  # the request's deadline has passed: not asked at all
    assert time.monotonic() - started < 1.5
    assert len(stand_in.paths) == 1


def test_an_unreachable_api_server_fails_closed():
    configuration = client.Configuration(host="http://127.0.0.1:9")  # discard: nothing listens
    may_get = AccessReviewer(client.ApiClient(configuration), budget_s=2.0)(User("alice"), "team-a")
    with pytest.raises(AccessReviewFailed, match='whether user "alice" may get secrets "s"'):
        may_get("secrets", "s")
