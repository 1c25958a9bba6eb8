"""`remote`: score batches of samples with an HTTP service (a verifier, a sandbox, a judge model).

Wire format (docs/rewards.md), one POST per `batch_size` samples to `reward.terms[i].url`:

    request:  {"data_source": [str], "solution_str": [str], "ground_truth": [str], "extra_info": [object]}
    response: {"scores": [v, ...]} or [v, ...], one v per sample in request order, each a number
              or an object {"score": number, <other numeric keys become metrics>}

with `Content-Type: application/json` and, when `token_env` names an environment variable,
`Authorization: Bearer <its value>`. The token goes to an http:// URL only with `allow_insecure`:
config/reward.py refuses that config, and the client checks again because it is what sends the
token. A connection error, a timeout (`timeout_s`), HTTP 5xx or 429 is retried up to
`max_retries` times with exponential backoff; any other status, or a response that does not
follow the format, is not. After the last attempt every sample of the batch gets the error
(`reward.on_error` decides), which names the URL, the status and the start of the body.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import requests

from rldock.config.reward import REMOTE_MAX_RETRIES, REMOTE_TIMEOUT_S, RewardTermSpec
from rldock.runtime.rewards.terms import BatchRewardFn, RewardBatch, RewardError, register_reward

logger = logging.getLogger(__name__)

BACKOFF_S = 0.5  # the first retry waits this long, each later one twice as long as the one before
MAX_BACKOFF_S = 8.0
BODY_EXCERPT = 300  # characters of a failed response's body quoted in the error
_RETRIED = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)


class RemoteRewardError(RuntimeError):
    """The service did not answer a batch usefully; the message says why."""


class RemoteReward:
    """The batch function of one `remote` term."""

    def __init__(self, term: RewardTermSpec, at: str):
        assert term.url is not None  # config/reward.py requires it for a `remote` term
        self.url, self.at = term.url, at
        self.timeout_s = REMOTE_TIMEOUT_S if term.timeout_s is None else term.timeout_s
        self.max_retries = REMOTE_MAX_RETRIES if term.max_retries is None else term.max_retries
        self.batch_size = term.batch_size
        self.headers = {"Content-Type": "application/json"}
        if term.sends_token_in_clear:
            raise RewardError(
                f"{at}.url: {term.url!r} would send the bearer token of token_env {term.token_env} "
                "unencrypted; use an https:// URL, or set allow_insecure: true on this term"
            )
        if term.token_env is not None:
            token = os.environ.get(term.token_env)
            if not token:
                raise RewardError(
                    f"{at}.token_env: the environment variable {term.token_env} is not set or "
                    "empty; export it (in an RLJob: `env` from a Secret) or remove token_env"
                )
            self.headers["Authorization"] = f"Bearer {token}"
        self.session = requests.Session()  # keeps the connection open between batches

    def __call__(self, batch: RewardBatch) -> list[Any]:
        size = self.batch_size or max(len(batch), 1)
        outcomes: list[Any] = []
        for start in range(0, len(batch), size):
            chunk = slice(start, start + size)
            payload = {
                "data_source": batch.data_sources[chunk],
                "solution_str": batch.solution_strs[chunk],
                "ground_truth": batch.ground_truths[chunk],
                "extra_info": batch.extra_infos[chunk],
            }
            num = len(batch.solution_strs[chunk])
            try:
                outcomes.extend(self.post(payload, num))
            except RemoteRewardError as error:
                outcomes.extend([error] * num)
        return outcomes

    def post(self, payload: dict, num: int) -> list[Any]:
        """The service's values for the `num` samples of `payload`, after retries."""
        try:
            body = json.dumps(payload)
        except (TypeError, ValueError) as error:  # e.g. an extra_info value JSON has no type for
            raise RemoteRewardError(f"the batch for {self.url} is not JSON: {error}") from None
        attempts = self.max_retries + 1
        last = ""
        for attempt in range(attempts):
            if attempt:
                delay = min(BACKOFF_S * 2 ** (attempt - 1), MAX_BACKOFF_S)
                logger.warning(
                    "%s: POST %s failed (%s); retry %d of %d in %.1f s",
                    self.at,
                    self.url,
                    last,
                    attempt,
                    self.max_retries,
                    delay,
                )
                time.sleep(delay)
            try:
                response = self.session.post(self.url, data=body, headers=self.headers, timeout=self.timeout_s)
            except _RETRIED as error:
                last = f"{type(error).__name__}: {error}"
                continue
            if response.status_code >= 500 or response.status_code == 429:
                last = f"HTTP {response.status_code}: {response.text[:BODY_EXCERPT]!r}"
                continue
            if not response.ok:
                raise RemoteRewardError(
                    f"POST {self.url} returned HTTP {response.status_code} (not retried): "
                    f"{response.text[:BODY_EXCERPT]!r}"
                )
            return self._values(response, num)
        raise RemoteRewardError(
            f"POST {self.url} failed after {attempts} attempt(s) (timeout_s {self.timeout_s:g}); last: {last}"
        )

    def _values(self, response: requests.Response, num: int) -> list[Any]:
        try:
            body = response.json()
        except ValueError:
            raise RemoteRewardError(
                f"POST {self.url} answered with a body that is not JSON: {response.text[:BODY_EXCERPT]!r}"
            ) from None
        values = body.get("scores") if isinstance(body, dict) else body
        if not isinstance(values, list) or len(values) != num:
            raise RemoteRewardError(
                f'POST {self.url} must answer {{"scores": [...]}} or a list with {num} '
                f"values, one per sample; got {response.text[:BODY_EXCERPT]!r}"
            )
        return values


@register_reward("remote")
def _build_remote(term: RewardTermSpec, at: str) -> BatchRewardFn:
    return RemoteReward(term, at)
