"""What one request may cost the gateway (gateway/server.py, "What one request may cost"; issue 64): its length
checked before anything is rendered, its rendering off the event loop, its body read in its episode's turn
and an episode's requests in flight capped, the renderers cached a fixed number. The routes, sessions and
chat template are the real ones over HTTP; the engine is the scripted double, and where a render must be
slow, the renderer is wrapped by a test double that sleeps in it."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from test_gateway import USER, _open, episodes, job, post, tokenizer  # noqa: F401 - the fixtures

from rldock.runtime.gateway.episodes import KEPT_TOOLS_CHARS, RendererCache
from rldock.runtime.gateway.server import TEXT_SLACK
from rldock_e2e.doubles.scripted_engine import ScriptedEngine

CONTEXT = 64 + 256  # the test job's prompt capacity (test_gateway.PROMPT_CAPACITY) + max_response_length


@pytest.fixture
def gateway(episodes, tokenizer):  # noqa: F811 - the fixtures imported above
    """Episodes e1 and e2 open on a gateway whose engine pumps in a thread (held while `hold` is clear):
    (runner, {name: key}, hold)."""
    runner = episodes()
    hold = threading.Event()
    hold.set()
    engine = ScriptedEngine(tokenizer, {1: ["5"] * 8, 2: ["5"] * 8}, hold=hold)
    opened = {name: runner.server.run(_open(runner, name, key)).result() for name, key in (("e1", 1), ("e2", 2))}
    runner.turns.open([1, 2])
    pump = threading.Thread(
        target=runner.turns.pump,
        args=(engine,),
        kwargs={"keys": [1, 2], "eos_token_id": tokenizer.eos_token_id, "seed": 0},
    )
    pump.start()
    yield runner, opened, hold
    hold.set()
    runner.turns.end(1)
    runner.turns.end(2)
    pump.join()


def chat(runner, episode, name, body, *, timeout=30.0):
    url = runner.server.base_url(name) + "/chat/completions"
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {episode.token}"}, timeout=timeout)


class RecordingRenderer:
    """A test double around the session's renderer factory: counts the renders asked, and sleeps `delay_s`
    in each (a render that takes long) after setting `started`."""

    def __init__(self, renderers, *, delay_s: float = 0.0):
        self.renderers, self.delay_s = renderers, delay_s
        self.calls = 0
        self.started = threading.Event()

    def __call__(self, tools):
        self.calls += 1
        self.started.set()
        time.sleep(self.delay_s)  # blocking, as rendering a long conversation is
        return self.renderers(tools)


# --- 1. the length, before anything is rendered -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        # more text than the context could hold at the vocabulary's longest token, TEXT_SLACK times over
        ([{"role": "user", "content": "x" * (TEXT_SLACK * 5 * CONTEXT + 1)}], f"past the limit of {2 * 5 * CONTEXT}"),
        # the same counted over a content of text parts
        (
            [{"role": "user", "content": [{"type": "text", "text": "x" * (TEXT_SLACK * 5 * CONTEXT + 1)}]}],
            "past the limit",
        ),
        # more messages than the context has tokens (each message is at least its role's markup)
        ([{"role": "user", "content": ""}] * (CONTEXT + 1), f"more than the {CONTEXT} tokens"),
    ],
)
def test_a_conversation_that_cannot_fit_is_refused_before_it_is_rendered(gateway, messages, words):
    runner, opened, _ = gateway
    recording = RecordingRenderer(runner.renderers)
    opened["e1"].session.renderer = recording
    answer = chat(runner, opened["e1"], "e1", {"model": "policy", "messages": messages})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded"
    assert words in error["message"] and "data.max_prompt_length" in error["message"]
    assert recording.calls == 0  # refused before any rendering or tokenizing
    # the tiny tokenizer's longest token is 5 characters ("<pad>"): the bound is derived from the vocabulary
    assert runner.gateway.shaper.token_chars == 5


def test_a_conversation_under_the_bound_is_rendered_and_refused_by_its_tokens_as_before(gateway):
    runner, opened, _ = gateway
    answer = chat(runner, opened["e1"], "e1", {"messages": [{"role": "user", "content": "x" * 2 * CONTEXT}]})
    assert answer.status_code == 400 and "leaves no token to sample" in answer.json()["error"]["message"]


# --- 2. rendering off the event loop ---------------------------------------------------------------------------


def test_a_slow_render_holds_its_own_episode_only(gateway):
    """Episode e1's render takes 3 s (a test double sleeping in it, as a long conversation's render would):
    meanwhile e2's turn and /health are answered at once. Rendered on the event loop, both waited the 3 s."""
    runner, opened, _ = gateway
    slow = RecordingRenderer(runner.renderers, delay_s=3.0)
    opened["e1"].session.renderer = slow
    answers = {}
    started = time.perf_counter()
    first = threading.Thread(
        target=lambda: answers.setdefault("e1", chat(runner, opened["e1"], "e1", {"messages": USER}))
    )
    first.start()
    assert slow.started.wait(10)
    health = httpx.get(runner.server.url + "/health", timeout=30)
    other = chat(runner, opened["e2"], "e2", {"messages": USER})
    meanwhile = time.perf_counter() - started
    first.join()
    assert health.status_code == 200 and other.status_code == 200, other.text
    assert meanwhile < 2.0, f"another episode's turn waited {meanwhile:.2f} s behind a slow render"
    assert answers["e1"].status_code == 200 and time.perf_counter() - started >= 3.0


# --- 4. bodies read in their episode's turn, requests in flight capped -----------------------------------------------


def _waiting(runner, check, *, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "the gateway never reached the state the test waits for"
        time.sleep(0.005)


def test_a_request_waiting_for_its_episodes_turn_has_its_body_unread(gateway):
    """While e1's first turn is held in the engine, a second request of e1 with a body that is not JSON is not
    answered: its body is read only in its turn, after the first's answer. Read before the lock, it was
    answered 400 at once, its body parsed while it waited."""
    runner, opened, hold = gateway
    hold.clear()
    answers = {}
    first = threading.Thread(
        target=lambda: answers.setdefault("first", chat(runner, opened["e1"], "e1", {"messages": USER}))
    )
    first.start()
    _waiting(runner, lambda: runner.turns.waiting == 1)
    url = runner.server.base_url("e1") + "/chat/completions"

    def second():
        answers["second"] = post(url, opened["e1"].token, None, raw=b"{not json")

    waiting = threading.Thread(target=second)
    waiting.start()
    waiting.join(1.0)
    assert "second" not in answers, "the second request's body was read while the first held the episode's turn"
    hold.set()
    first.join()
    waiting.join()
    assert answers["first"].status_code == 200
    assert answers["second"].status_code == 400 and "not JSON" in answers["second"].json()["error"]["message"]


def test_requests_of_one_episode_past_its_cap_get_a_429_with_retry_after(gateway):
    runner, opened, hold = gateway
    runner.gateway.max_requests_per_episode = 2
    hold.clear()
    threads = [threading.Thread(target=chat, args=(runner, opened["e1"], "e1", {"messages": USER})) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        _waiting(runner, lambda: runner.turns.waiting == 1)  # one held in the engine
        _waiting(runner, lambda: opened["e1"].in_flight == 2)  # the other in flight, waiting for its turn
        answer = chat(runner, opened["e1"], "e1", {"messages": USER}, timeout=5)
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert "2 requests of this episode are in flight" in answer.json()["error"]["message"]
        # another episode is not held back by e1's
        assert runner.gateway.episodes["e2"].in_flight == 0
    finally:
        hold.set()
        for thread in threads:
            thread.join()
    assert opened["e1"].in_flight == 0


def _until_closed(client: socket.socket) -> bytes:
    """What the server sends until it closes the connection (the socket's timeout if it never does)."""
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    return received


def test_a_body_that_trickles_is_refused_408_and_its_turn_freed(gateway):
    runner, opened, _ = gateway
    runner.gateway.body_timeout_s = 0.3
    host, port = runner.server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall(
            b"POST /sessions/e1/v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
            + f"Authorization: Bearer {opened['e1'].token}\r\n".encode()
            + b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"messages"'
        )
        answer = _until_closed(client)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"did not arrive within 0.3 s" in answer and b"connection: close" in answer
    runner.gateway.body_timeout_s = 30.0
    assert chat(runner, opened["e1"], "e1", {"messages": USER}).status_code == 200  # the episode's turn is free


def test_a_reward_body_is_small(gateway):
    runner, opened, _ = gateway
    url = runner.server.url + "/sessions/e1/reward"
    headers = {"Authorization": f"Bearer {opened['e1'].token}"}
    answer = httpx.post(url, json={"reward": 1.0, "note": "x" * (64 << 10)}, headers=headers, timeout=30)
    assert answer.status_code == 400 and "past the limit of 65536" in answer.json()["error"]["message"]
    assert httpx.post(url, json={"reward": 1.0}, headers=headers, timeout=30).json() == {"rewards": 1}


# --- the renderer cache -----------------------------------------------------------------------------------------------


def _tools(name: str, description: str = "") -> list[dict]:
    return [{"type": "function", "function": {"name": name, "description": description, "parameters": {}}}]


def test_the_renderer_cache_keeps_the_most_recently_used_up_to_its_size(tokenizer):  # noqa: F811
    cache = RendererCache(tokenizer, size=3)
    first = cache(_tools("t0"))
    for index in range(1, 20):  # a harness sending a new tools list each request
        cache(_tools(f"t{index}"))
        assert len(cache) <= 3
    assert len(cache) == 3
    assert cache(_tools("t19")) is cache(_tools("t19"))  # a hit
    assert cache(_tools("t0")) is not first  # evicted long ago, built again
    cache(_tools("t18"))
    cache(_tools("t_new"))  # evicts the least recently used: t19 (t0 and t18 were used after it)
    assert cache(_tools("t18")) is cache(_tools("t18")) and len(cache) == 3
    # a tools list longer than KEPT_TOOLS_CHARS is rendered for its request, never kept
    huge = _tools("big", "d" * KEPT_TOOLS_CHARS)
    assert cache(huge).tools == huge and len(cache) == 3 and cache(huge) is not cache(huge)
