"""The admission webhook (rldock.operator.admission): what `review` allows and refuses, table by
table, and the HTTPS server's bounds (size, deadline, connections) against a certificate made here.
(Its question whether the user may read what an RLJob names: test_references.py.)"""

from __future__ import annotations

import copy
import datetime
import functools
import http.client
import ipaddress
import json
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from rljob_testing import job_dict, rljob_object

from rldock.operator.admission import (
    MAX_REVIEW_BYTES,
    REFUSED_CODE,
    WEBHOOK_PATH,
    ReviewError,
    WebhookServer,
    decide,
    review,
)
from rldock.operator.constants import MANAGED_BY_RLDOCK
from rldock.operator.policy import AdminPolicy, policy_problems
from rldock.operator.settings import OperatorSettings, load_settings
from rldock.operator.validation import parse_spec

UID = "705ab4f5-6393-11e8-b7cc-42010a800002"
SETTINGS = OperatorSettings()
HOST_ROOT = {
    "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
    "volumeMounts": [{"name": "root", "mountPath": "/host"}],
}
MULTIKUEUE = "kueue.x-k8s.io/multikueue"


def grant_all(user: Any, namespace: str) -> Any:
    """Test double of access_review.AccessReviewer: every user may read every object."""
    return lambda resource, name: True


def with_spec(obj: dict[str, Any], **changes: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["spec"].update(changes)
    return obj


def request(
    operation: str, obj: dict[str, Any] | None, old: dict[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    """An AdmissionReview request as the API server sends it for an RLJob."""
    return {
        "uid": UID,
        "kind": {"group": "rldock.io", "version": "v1alpha1", "kind": "RLJob"},
        "resource": {"group": "rldock.io", "version": "v1alpha1", "resource": "rljobs"},
        "name": "grpo",
        "namespace": "team-a",
        "operation": operation,
        "object": obj,
        "oldObject": old,
        "userInfo": {"username": "alice"},
        **fields,
    }


def admission_review(req: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


VALID = rljob_object()
INVALID = rljob_object(job={"name": "grpo-test"})  # the job config's required sections are missing
OUTSIDE_POLICY = rljob_object(**HOST_ROOT)
CONTEXT_PARALLEL_JOB = {
    **job_dict(),
    "training": {"data_parallel_size": 2, "context_parallel_size": 2, "strategy": "fsdp"},
}
CONTEXT_PARALLEL_WITH_EXPERTS = {
    **CONTEXT_PARALLEL_JOB,
    "training": {**CONTEXT_PARALLEL_JOB["training"], "expert_parallel_size": 2},
}
CONTEXT_PARALLEL_WITH_UNEVEN_EXPERTS = {
    **CONTEXT_PARALLEL_JOB,
    "training": {**CONTEXT_PARALLEL_JOB["training"], "expert_parallel_size": 3},
}
ELSEWHERE = with_spec(OUTSIDE_POLICY, managedBy=MULTIKUEUE)


# --- What is allowed and what is refused ------------------------------------------------------


@pytest.mark.parametrize(
    "req, reason, fields",
    [
        # CREATE: checked in full
        (request("CREATE", VALID), None, ()),
        (request("CREATE", with_spec(VALID, managedBy=MANAGED_BY_RLDOCK)), None, ()),
        (request("CREATE", INVALID), "InvalidSpec", ("spec.job",)),
        # rldock train seats DP x CP ranks, EP groups carved out of them; an EP size that does not
        # tile them is refused: no RayCluster sized for it
        (request("CREATE", rljob_object(job=CONTEXT_PARALLEL_JOB)), None, ()),
        (request("CREATE", rljob_object(job=CONTEXT_PARALLEL_WITH_EXPERTS)), None, ()),
        (
            request("CREATE", rljob_object(job=CONTEXT_PARALLEL_WITH_UNEVEN_EXPERTS)),
            "InvalidSpec",
            ("spec.job.training.expert_parallel_size: 3 must divide the 4 sequence ranks",),
        ),
        (
            request("CREATE", OUTSIDE_POLICY),
            "PolicyDenied",
            ("spec.volumes[0].hostPath.path", "policy.hostPathPrefixes"),
        ),
        (
            request("CREATE", rljob_object(checkpoint={"hostPath": "/mnt/rl"}, image="docker.io/evil:1", **HOST_ROOT)),
            "PolicyDenied",
            ("spec.checkpoint.hostPath", "spec.volumes[0].hostPath.path", "spec.image", "policy.imagePrefixes"),
        ),
        # quantities the schema's pattern accepts: "1Ei" is an amount (over the bound), an exponent
        # past what the operator can read is refused naming its field
        (
            request("CREATE", rljob_object(environments=[{"name": "e", "resources": {"cpu": 1, "memory": "1Ei"}}])),
            "PolicyDenied",
            ("spec.environments[0].resources.memory", "policy.environments.maxMemory"),
        ),
        (
            request("CREATE", rljob_object(environments=[{"name": "e", "ephemeralStorage": "1e99999999999"}])),
            "InvalidSpec",
            ("spec.environments[0].ephemeralStorage", "too large an amount"),
        ),
        # managed by another controller: its own rules hold, this cluster's policy is not for it
        (request("CREATE", ELSEWHERE), None, ()),
        (request("CREATE", with_spec(INVALID, managedBy=MULTIKUEUE)), "InvalidSpec", ("spec.job",)),
        # UPDATE: a changed spec is checked as a CREATE would be
        (request("UPDATE", VALID, VALID), None, ()),
        (request("UPDATE", OUTSIDE_POLICY, VALID), "PolicyDenied", ("spec.volumes[0].hostPath.path",)),
        (request("UPDATE", INVALID, VALID), "InvalidSpec", ("spec.job",)),
        # ... an unchanged one (labels, finalizers, kopf's annotations) is not: it was checked when written
        (
            request("UPDATE", {**OUTSIDE_POLICY, "metadata": {"name": "grpo", "finalizers": []}}, OUTSIDE_POLICY),
            None,
            (),
        ),
        # managedBy is immutable, either way
        (request("UPDATE", with_spec(VALID, managedBy=MULTIKUEUE), VALID), "InvalidSpec", ("spec.managedBy",)),
        (request("UPDATE", VALID, ELSEWHERE), "InvalidSpec", ("spec.managedBy", "immutable")),
        (request("UPDATE", with_spec(VALID, managedBy=MANAGED_BY_RLDOCK), VALID), "InvalidSpec", ("spec.managedBy",)),
        # not ours to refuse
        (request("DELETE", None, OUTSIDE_POLICY), None, ()),
        (request("CONNECT", None), None, ()),
        (request("UPDATE", OUTSIDE_POLICY, VALID, subResource="status"), None, ()),
        (
            request("CREATE", OUTSIDE_POLICY, resource={"group": "ray.io", "version": "v1", "resource": "rayclusters"}),
            None,
            (),
        ),
    ],
)
def test_decide(req, reason, fields):
    verdict = decide(req, SETTINGS, grant_all)
    assert verdict.allowed == (reason is None)
    assert verdict.reason == reason
    for field in fields:
        assert field in verdict.message, (field, verdict.message)


def test_the_policy_is_the_operators():
    allowed = OperatorSettings(policy=AdminPolicy(host_path_prefixes=["/"]))
    assert decide(request("CREATE", OUTSIDE_POLICY), allowed, grant_all).allowed
    own_image = with_spec(VALID, image=SETTINGS.pod_defaults.image)
    assert decide(request("CREATE", own_image), SETTINGS, grant_all).allowed


def test_every_problem_is_listed_as_the_failed_condition_would_list_it():
    obj = rljob_object(image="docker.io/evil:1", **HOST_ROOT)
    verdict = decide(request("CREATE", obj), SETTINGS, grant_all)
    spec, _ = parse_spec(obj["spec"])
    problems = policy_problems(spec, SETTINGS.policy, default_image=SETTINGS.pod_defaults.image)
    assert [p.path for p in problems] == ["spec.volumes[0].hostPath.path", "spec.image"]
    assert verdict.message == "; ".join(f"{p.path}: {p.message}" for p in problems)
    assert "(policy.hostPathPrefixes: [])" in verdict.message


def test_review_answers_the_request_uid_with_a_422_status():
    answer = review(admission_review(request("CREATE", OUTSIDE_POLICY)), SETTINGS, grant_all)
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == UID and response["allowed"] is False
    assert response["status"]["code"] == REFUSED_CODE == 422
    assert response["status"]["reason"] == "PolicyDenied"
    assert response["status"]["message"].startswith("spec.volumes[0].hostPath.path: hostPath '/' is not allowed")
    assert review(admission_review(request("CREATE", VALID)), SETTINGS, grant_all)["response"] == {
        "uid": UID,
        "allowed": True,
    }


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {"kind": "AdmissionReview"},
        {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": UID}},
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": ""}},
        admission_review(request("CREATE", ["not", "an", "object"])),
        admission_review(request("CREATE", {**VALID, "spec": "x"})),
        admission_review(request("UPDATE", VALID, {"spec": 3})),
    ],
)
def test_what_is_not_an_admission_review_is_refused(body):
    with pytest.raises(ReviewError):
        review(body, SETTINGS, grant_all)


# --- The HTTPS server -------------------------------------------------------------------------


def write_certificate(folder: Path, common_name: str = "rldock-webhook-test") -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (TEST ONLY) as tls.crt and tls.key in `folder`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    (folder / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "tls.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return folder / "tls.crt", folder / "tls.key"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_certificate(tmp_path_factory.mktemp("webhook-cert"))


def start_server(certificate: tuple[Path, Path], **bounds: Any) -> WebhookServer:
    cert, key = certificate
    return WebhookServer(
        functools.partial(review, settings=SETTINGS, access=grant_all),
        port=0,
        host="127.0.0.1",
        cert_file=str(cert),
        key_file=str(key),
        **bounds,
    ).start()


@pytest.fixture
def server(certificate: tuple[Path, Path]) -> Iterator[WebhookServer]:
    started = start_server(certificate, deadline_s=1.0)
    yield started
    started.stop()


def client_context(certificate: tuple[Path, Path]) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certificate[0]))
    return context


def post(
    server: WebhookServer,
    certificate: tuple[Path, Path],
    body: bytes,
    *,
    path: str = WEBHOOK_PATH,
    headers: dict[str, str] | None = None,
) -> tuple[int, bytes]:
    connection = http.client.HTTPSConnection("127.0.0.1", server.port, context=client_context(certificate), timeout=5)
    try:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_server_answers_a_review_over_verified_tls(server, certificate):
    status, body = post(server, certificate, json.dumps(admission_review(request("CREATE", OUTSIDE_POLICY))).encode())
    assert status == 200
    response = json.loads(body)["response"]
    assert response["allowed"] is False and response["status"]["reason"] == "PolicyDenied"


@pytest.mark.parametrize(
    "body, path, code",
    [
        (b"{", WEBHOOK_PATH, 400),
        (b'{"kind": "Pod"}', WEBHOOK_PATH, 400),
        (b"{}", "/mutate", 404),
    ],
)
def test_server_refuses_what_is_not_a_review(server, certificate, body, path, code):
    assert post(server, certificate, body, path=path)[0] == code


def test_server_refuses_a_body_over_the_cap_before_reading_it(server, certificate):
    # Only the header is sent: the answer comes without the body being read.
    status, _ = post(server, certificate, b"", headers={"Content-Length": str(MAX_REVIEW_BYTES + 1)})
    assert status == 413


def _tls_connect(server: WebhookServer, certificate: tuple[Path, Path]) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return client_context(certificate).wrap_socket(raw, server_hostname="127.0.0.1")


def test_a_slow_client_is_cut_off_at_the_deadline(server, certificate):
    """A client that stalls (before the TLS handshake, in the body) or trickles (a header, a byte
    at a time) holds its connection only until the deadline (1 s here)."""
    for stall_in in ("tcp", "headers", "body"):
        started = time.monotonic()
        if stall_in == "tcp":  # not even the TLS handshake
            sock: socket.socket = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        else:
            sock = _tls_connect(server, certificate)
            sock.sendall(f"POST {WEBHOOK_PATH} HTTP/1.1\r\nHost: x\r\n".encode())
            if stall_in == "body":
                sock.sendall(b"Content-Length: 100\r\n\r\n{")
        with sock:
            sock.settimeout(0.2)
            while time.monotonic() - started < 5:
                try:
                    if not sock.recv(1024):
                        break  # closed by the server
                except TimeoutError:
                    if stall_in == "headers":
                        try:
                            sock.sendall(b"x")  # one more byte of a header that never ends
                        except OSError:
                            break
                except OSError:  # reset, or the TLS session cut
                    break
        assert time.monotonic() - started < 3, stall_in


def test_connections_over_the_cap_are_closed_at_once(certificate):
    server = start_server(certificate, max_connections=1, deadline_s=3.0)
    try:
        holder = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # takes the one slot
        # Wait until the server has accepted it (its one slot taken), however slow the machine.
        deadline = time.monotonic() + 10
        while server._server.in_flight() != 1:  # noqa: SLF001 (the server's connection slots)
            assert time.monotonic() < deadline, "the server never accepted the first connection"
            time.sleep(0.01)
        with pytest.raises((ConnectionError, ssl.SSLError, OSError)):
            _tls_connect(server, certificate)
        holder.close()
        deadline = time.monotonic() + 5
        while True:  # the slot comes back once the holder's connection ends
            try:
                status, _ = post(server, certificate, b"{}")
                break
            except (ConnectionError, ssl.SSLError, OSError):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert status == 400
    finally:
        server.stop()


def _served_common_name(port: int) -> str:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only reads which one is served
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, context.wrap_socket(raw) as tls:
        cert = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def test_a_rotated_certificate_is_served_without_a_restart(tmp_path):
    """The kubelet swaps a mounted Secret's files in place; a half-written pair is not served."""
    live, staged = tmp_path / "live", tmp_path / "staged"
    live.mkdir(), staged.mkdir()
    server = start_server(write_certificate(live, "first"))
    try:
        assert _served_common_name(server.port) == "first"
        write_certificate(staged, "second")
        (live / "tls.crt").write_bytes((staged / "tls.crt").read_bytes())  # the key does not match yet
        assert _served_common_name(server.port) == "first"
        (live / "tls.key").write_bytes((staged / "tls.key").read_bytes())
        assert _served_common_name(server.port) == "second"
    finally:
        server.stop()


# --- Settings ---------------------------------------------------------------------------------


def test_webhook_settings_from_the_environment_and_flags():
    env = {
        "RLDOCK_TOKEN_KEY": "k" * 32,
        "RLDOCK_WEBHOOK_PORT": "9443",
        "RLDOCK_WEBHOOK_CERT_FILE": "/etc/webhook/tls.crt",
        "RLDOCK_WEBHOOK_KEY_FILE": "/etc/webhook/tls.key",
    }
    settings = load_settings([], env)
    assert (settings.webhook_port, settings.webhook_cert_file, settings.webhook_key_file) == (
        9443,
        "/etc/webhook/tls.crt",
        "/etc/webhook/tls.key",
    )
    assert load_settings(["--webhook-port", "8443"], env).webhook_port == 8443
    assert load_settings([], {"RLDOCK_TOKEN_KEY": "k" * 32}).webhook_port is None


@pytest.mark.parametrize("drop", ["RLDOCK_WEBHOOK_CERT_FILE", "RLDOCK_WEBHOOK_KEY_FILE"])
def test_a_webhook_port_without_its_certificate_stops_the_operator_at_start(drop, capsys):
    env = {
        "RLDOCK_TOKEN_KEY": "k" * 32,
        "RLDOCK_WEBHOOK_PORT": "9443",
        "RLDOCK_WEBHOOK_CERT_FILE": "/c",
        "RLDOCK_WEBHOOK_KEY_FILE": "/k",
    }
    del env[drop]
    with pytest.raises(SystemExit):
        load_settings([], env)
    assert "--webhook-cert-file" in capsys.readouterr().err
