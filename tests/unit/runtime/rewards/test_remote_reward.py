"""`remote` terms against a real HTTP server on localhost: the wire format, the bearer token,
batching, retries with backoff, timeouts, and the errors after the last attempt."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rldock.config import RewardSpec
from rldock.runtime.rewards import RewardError, RewardScorer, remote


class ScoringServer:
    """A real HTTP server whose answers the test scripts: `plan` holds (status, body, delay_s) for
    the next requests; once it is used up, requests are scored by length (or by `reply`)."""

    def __init__(self):
        self.requests: list[dict] = []
        self.plan: list[tuple[int, str, float]] = []
        self.reply = lambda body: {"scores": [float(len(s)) for s in body["solution_str"]]}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"body": body, "headers": dict(self.headers), "path": self.path})
                status, text, delay = server.plan.pop(0) if server.plan else (200, json.dumps(server.reply(body)), 0)
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(text.encode())
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left: what the timeout test wants

            def log_message(self, *args):  # quiet
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    running = ScoringServer()
    yield running
    running.close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.05)


def _scorer(url: str, *, on_error: str = "fail", **options) -> RewardScorer:
    return RewardScorer(RewardSpec(terms=[{"name": "remote", "url": url, **options}], on_error=on_error))


def _score(scorer: RewardScorer, responses: list[str]):
    num = len(responses)
    return scorer.score(responses, ["gt"] * num, ["gsm8k"] * num, [{"i": i} for i in range(num)])


def test_posts_the_four_columns_and_reads_the_scores(server):
    scored = _score(_scorer(server.url), ["a", "bbb"])
    assert scored.scores.tolist() == [1.0, 3.0]
    (request,) = server.requests
    assert request["body"] == {
        "data_source": ["gsm8k", "gsm8k"],
        "solution_str": ["a", "bbb"],
        "ground_truth": ["gt", "gt"],
        "extra_info": [{"i": 0}, {"i": 1}],
    }
    assert request["headers"]["Content-Type"] == "application/json"
    assert "Authorization" not in request["headers"]


def test_a_plain_list_of_dicts_gives_scores_and_metrics(server):
    server.reply = lambda body: [
        {"score": 1.0, "judge_confidence": 0.5 * i} for i, _ in enumerate(body["solution_str"])
    ]
    scored = _score(_scorer(server.url), ["a", "b"])
    assert scored.scores.tolist() == [1.0, 1.0]
    assert scored.metrics["reward/remote/judge_confidence"] == 0.25


def test_batch_size_splits_requests_in_order(server):
    scored = _score(_scorer(server.url, batch_size=2), ["a", "bb", "ccc", "dddd", "eeeee"])
    assert scored.scores.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [r["body"]["solution_str"] for r in server.requests] == [["a", "bb"], ["ccc", "dddd"], ["eeeee"]]


def test_the_bearer_token_comes_from_the_named_environment_variable(server, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "s3cret")
    _score(_scorer(server.url, token_env="RM_TOKEN", allow_insecure=True), ["a"])  # the server is on loopback
    assert server.requests[0]["headers"]["Authorization"] == "Bearer s3cret"


def test_a_token_over_plain_http_is_refused_when_the_term_is_built(server, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "s3cret")
    with pytest.raises(
        RewardError,
        match=r"reward.terms\[0\].url: .* would send the bearer token of token_env "
        r"RM_TOKEN unencrypted; use an https:// URL, or set allow_insecure: true",
    ):
        _scorer(server.url, token_env="RM_TOKEN")
    assert server.requests == []


def test_an_unset_token_variable_fails_when_the_term_is_built(server, monkeypatch):
    monkeypatch.delenv("RM_TOKEN", raising=False)
    with pytest.raises(RewardError, match=r"reward.terms\[0\].token_env: the environment variable RM_TOKEN is not set"):
        _scorer(server.url, token_env="RM_TOKEN", allow_insecure=True)


def test_a_server_failing_twice_then_answering_is_retried_with_growing_backoff(server):
    server.plan = [(500, "overloaded", 0), (503, "still overloaded", 0)]
    started = time.perf_counter()
    scored = _score(_scorer(server.url, max_retries=2), ["ab"])
    assert scored.scores.tolist() == [2.0] and len(server.requests) == 3
    assert time.perf_counter() - started >= 0.05 + 0.1  # waited BACKOFF_S, then twice that


def test_a_server_that_always_fails_gives_an_error_with_the_url_status_and_body(server):
    server.plan = [(500, "database is down", 0)] * 3
    with pytest.raises(
        RewardError,
        match=r"reward.terms\[0\] \(remote http://127.0.0.1:\d+/score\) failed on a "
        r"sample from data_source 'gsm8k': RemoteRewardError: POST .* failed after "
        r"3 attempt\(s\).*HTTP 500: 'database is down'",
    ):
        _score(_scorer(server.url, max_retries=2), ["a"])
    assert len(server.requests) == 3


def test_a_timeout_is_retried_then_reported(server):
    server.plan = [(200, '{"scores": [1.0]}', 1.0)] * 2
    with pytest.raises(RewardError, match=r"failed after 2 attempt\(s\) \(timeout_s 0.2\); last: .*Timeout"):
        _score(_scorer(server.url, max_retries=1, timeout_s=0.2), ["a"])


def test_a_client_error_is_not_retried(server):
    server.plan = [(401, "bad token", 0)]
    with pytest.raises(RewardError, match=r"returned HTTP 401 \(not retried\): 'bad token'"):
        _score(_scorer(server.url, max_retries=3), ["a"])
    assert len(server.requests) == 1


@pytest.mark.parametrize(
    "text, words",
    [
        ("not json", "not JSON"),
        ('{"scores": [1.0, 2.0]}', r"with 1 values, one per sample"),
        ('{"score": 1.0}', r"must answer"),
    ],
)
def test_a_malformed_answer_is_reported(server, text, words):
    server.plan = [(200, text, 0)]
    with pytest.raises(RewardError, match=words):
        _score(_scorer(server.url), ["a"])


def test_nothing_listening_is_a_connection_error_after_the_retries():
    with pytest.raises(RewardError, match=r"failed after 2 attempt\(s\).*ConnectionError"):
        _score(_scorer("http://127.0.0.1:9/score", max_retries=1, timeout_s=2), ["a"])


def test_on_error_zero_scores_a_failed_batch_zero_and_counts_it(server):
    server.plan = [(500, "down", 0)]
    scored = _score(_scorer(server.url, on_error="zero", max_retries=0, batch_size=2), ["a", "b", "ccc"])
    assert scored.scores.tolist() == [0.0, 0.0, 3.0]  # the first request failed, the second did not
    assert scored.metrics["reward/errors"] == 2.0


def test_an_extra_info_that_is_not_json_is_reported_without_a_request(server):
    scorer = _scorer(server.url)
    with pytest.raises(RewardError, match=r"the batch for .* is not JSON: Object of type set"):
        scorer.score(["a"], ["gt"], ["gsm8k"], [{"tags": {"x"}}])
    assert server.requests == []
