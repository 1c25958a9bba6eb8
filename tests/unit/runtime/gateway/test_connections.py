"""The gateway's connections (gateway/connections.py; issue 64): a connection that never completes a request
head is closed at the head deadline, one past the cap is answered 503 and closed while the others keep
theirs, a body answered without being read must arrive by the body deadline, and the pods' lease route
refuses a body that trickles without leasing an episode. Served by a GatewayLoop of the test gateway with
short deadlines, over raw sockets (a client that behaves as no HTTP library would)."""

from __future__ import annotations

import socket
import time

import httpx
import pytest
from test_gateway import _open, episodes, job, tokenizer  # noqa: F401 - the fixtures

from rldock.runtime.gateway.dispatch import EpisodeDispatcher
from rldock.runtime.gateway.server import GatewayLoop

HEADER_TIMEOUT_S = 0.5
BODY_TIMEOUT_S = 0.5
MAX_CONNECTIONS = 3


@pytest.fixture
def guarded(episodes):  # noqa: F811 - the fixture imported above
    """The test gateway served with short deadlines and a cap of MAX_CONNECTIONS, episode e1 open on it and a
    pods' dispatcher mounted: (server, episode, dispatcher)."""
    runner = episodes()
    runner.gateway.body_timeout_s = BODY_TIMEOUT_S
    dispatcher = EpisodeDispatcher(token="pod-token", timeout_s=5.0, body_timeout_s=BODY_TIMEOUT_S)
    runner.gateway.mounts.append(dispatcher.mount)
    server = GatewayLoop(runner.gateway, max_connections=MAX_CONNECTIONS, header_timeout_s=HEADER_TIMEOUT_S)
    episode = server.run(_open(runner, "e1", 1)).result()
    yield server, episode, dispatcher
    server.close()


def connect(server: GatewayLoop) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def until_closed(client: socket.socket) -> tuple[bytes, float]:
    """What the server sends until it closes the connection, and the seconds that took (the socket's timeout,
    10 s, raises if it never does)."""
    started, received = time.perf_counter(), b""
    try:
        while chunk := client.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received, time.perf_counter() - started


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: gateway\r\n"])
def test_a_connection_that_never_completes_a_request_head_is_closed_at_the_head_deadline(guarded, sent):
    server, _, _ = guarded
    with connect(server) as client:
        client.sendall(sent)
        received, waited = until_closed(client)
    assert received == b"" and HEADER_TIMEOUT_S * 0.8 <= waited < HEADER_TIMEOUT_S + 3


def test_a_kept_alive_connection_must_send_its_next_head_in_time_too(guarded):
    server, _, _ = guarded
    with connect(server) as client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"status":"healthy"}'):
            answer += client.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200")
        client.sendall(b"GET /health HTTP/1.1\r\n")  # then nothing: keep-alive's idle timer no longer runs
        received, waited = until_closed(client)
    assert received == b"" and waited < HEADER_TIMEOUT_S + 3


def test_connections_past_the_cap_are_refused_and_an_authorised_request_gets_through_after(guarded):
    server, episode, _ = guarded
    idle = [connect(server) for _ in range(MAX_CONNECTIONS)]  # unauthenticated, sending nothing
    try:
        time.sleep(0.1)  # accepted by the server
        with connect(server) as extra:
            received, waited = until_closed(extra)
        assert received.startswith(b"HTTP/1.1 503") and b"too many connections" in received and waited < 2
        for client in idle:  # the head deadline frees their places
            assert until_closed(client)[0] == b""
    finally:
        for client in idle:
            client.close()
    models = httpx.get(
        server.base_url("e1") + "/models", headers={"Authorization": f"Bearer {episode.token}"}, timeout=10
    )
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "policy"


def test_a_body_answered_unread_must_arrive_by_the_body_deadline(guarded):
    server, _, _ = guarded
    with connect(server) as client:  # a wrong key: answered 401 before its body is read
        client.sendall(
            b"POST /sessions/e1/v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer wrong\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        received, waited = until_closed(client)
    assert received.startswith(b"HTTP/1.1 401") and waited < BODY_TIMEOUT_S + 3


def test_a_lease_whose_body_trickles_is_refused_and_leases_nothing(guarded):
    server, _, dispatcher = guarded
    offered = server.run(dispatcher({"prompt": "2+3?"}, name="p1", base_url=server.base_url("p1"), api_key="key"))
    with connect(server) as client:
        client.sendall(
            b"POST /episodes/lease HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer pod-token\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        received, _ = until_closed(client)
    assert received.startswith(b"HTTP/1.1 408") and dispatcher.leases == 0
    assert offered.result(timeout=30).ended == "harness_unserved"  # nobody leased it in its 5 s


def test_an_answer_does_not_wait_for_the_clients_delayed_ack(guarded):
    """50 requests on one kept-alive connection take well under a second: each connection has TCP_NODELAY.
    Without it (the listening socket's protocol number is 0, so asyncio never set it) an answer's body, written
    after its head, waited for the client's delayed ACK: about 45 ms a request here, 2.2 s for the 50."""
    server, _, _ = guarded
    with httpx.Client(timeout=10) as client:
        client.get(server.url + "/health")
        started = time.perf_counter()
        for _ in range(50):
            assert client.get(server.url + "/health").status_code == 200
        took = time.perf_counter() - started
    assert took < 1.0, f"50 requests took {took:.2f} s"
