"""The gateway's HTTP side: per-episode OpenAI-compatible routes, each turn one request of the rollout
engine that every other episode's turns share.

Routes (each episode's base URL is `http://<host>:<port>/sessions/<episode>/v1`, its key the bearer token
that opens that session only):

- `POST /sessions/<episode>/v1/chat/completions`: a chat turn (`stream: true` answers as server-sent
  events); the session (sessions.py) turns the messages into the exact ids the engine continues.
- `POST /sessions/<episode>/v1/completions`: a prompt of token ids, continued as is (a harness that
  renders its own prompts); an extension of the held ids extends the segment, any other prompt opens one.
- `POST /sessions/<episode>/v1/responses`: the Responses API (the OpenAI Agents SDK's default model), a
  chat turn under another shape: its input items become chat messages, its answer output items
  (responses.py says what each field becomes; `previous_response_id` continues this episode's response).
- `GET /sessions/<episode>/v1/models`: the one model served.
- `POST /sessions/<episode>/reward`: `{"reward": x}`, a reward for the episode's latest step: the model turn
  answered last before it (what `algorithm.credit: turn` credits it to).
- `GET /health`.

Limits, each refusal OpenAI's error body naming the field: a body past `max_body_bytes`, `n` other than 1,
another model's name, a prompt the episode's context cannot continue (400); more turns waiting for the
engine than `max_waiting`, or more requests of one episode in flight than `max_requests_per_episode` (429 with
Retry-After); a body not in within `body_timeout_s` (408); a wrong key or an episode not open here (401, the
same answer for both); a turn asked after its episode's harness ended (503: the episode is over);
a turn the engine refuses (400 with the engine's reason; its episode ends `engine_refused`). A request's
sampling settings are the job's (rollout.temperature, top_p): a turn is
sampled exactly as rldock's own loop samples one.

What one request may cost (a harness is not trusted to be kind; docs/agentic.md, "What the gateway holds"):
- Its length is checked before anything is rendered (`_check_fits`): messages whose text could not fit the
  episode's context even if every token were the vocabulary's longest (times `TEXT_SLACK`), or more messages
  than the context has tokens (each is at least its role's markup), are refused 400 `context_length_exceeded`.
- Rendering and tokenizing (`Session.plan`) run on the gateway's own `RENDER_THREADS` threads (not the loop's
  default executor, which in-process harnesses' `asyncio.to_thread` uses), so a long request holds its own
  episode only; the routes, other episodes' turns and the pods' heartbeats go on.
- Its body is read and parsed under its episode's lock, after the turns before it: a harness's parallel calls
  wait their turn with their bodies unread (held by the client, not here), at most `max_requests_per_episode`
  of them; a reward's body is at most `MAX_REWARD_BODY_BYTES`.
- Connections: at most `MAX_CONNECTIONS` open, a request's head within `HEADER_TIMEOUT_S`, its body within
  `BODY_TIMEOUT_S` (connections.py).

Rounds (rollout.partial_rollout resume): the engine may be pumped in rounds with a weight update between
them (`EngineTurns.pump` with a `RoundBudget`, chat/cut_turns.py). In a round with a token budget an episode
samples at most that many tokens; the turn being sampled when it reaches them is cut there, kept with each
token's version and logprob, and its rest is sampled from those tokens in the next round on the new
weights. Its HTTP request stays open meanwhile and gets one answer, the whole turn: a harness never sees a
cut. A round ends once every episode still running has spent its budget (a turn it asks then waits for the
next round); the harnesses go on running between rounds, their sessions open.

Concurrency: the routes run on the gateway's event loop (a thread of its own, `GatewayLoop`), the engine in
the rollout's thread (`EngineTurns.pump`), which is the one thread that calls it; a turn crosses between
them through a queue one way and `call_soon_threadsafe` the other. One request of an episode is served at
a time (its session's lock, held from reading its body to recording its answer), so a session's bookkeeping
never interleaves; its plan is made on a render thread while the loop waits for it, and committed on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import queue
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rldock.runtime.agent.interfaces import REWARD_LIMIT
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.chat.cut_turns import EMPTY_TURN, CutTurn, RoundBudget
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.gateway.answers import (
    ChatRequest,
    RequestError,
    Shaper,
    Turn,
    chat_request,
    completion_prompt,
    stream_chunks,
)
from rldock.runtime.gateway.connections import (
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    KEEP_ALIVE_S,
    MAX_HEADER_BYTES,
    BodyUnread,
    connection_cap,
    guarded_protocol,
    read_body,
)
from rldock.runtime.gateway.responses import response, responses_request, stream_events
from rldock.runtime.gateway.sessions import Plan, Session, request_digest

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request's body: a long conversation fits, a flood does not
MAX_REWARD_BODY_BYTES = 64 << 10  # a reward's body: `{"reward": x}` and room to spare
MAX_REQUESTS_PER_EPISODE = 16  # an episode's requests in flight: one served, the others waiting their turn
# The messages' text may be this many times what the context holds at the vocabulary's longest token (a token
# covers at most its own characters; the slack leaves room for a normalizer that folds characters).
TEXT_SLACK = 2
RENDER_THREADS = 4  # threads rendering and tokenizing requests, off the event loop
RETRY_AFTER_S = 1
# Responses API answers an episode keeps for previous_response_id (each holds its whole conversation): an
# agent continues its latest; a bound keeps a long episode's memory linear in its turns, not quadratic.
RESPONSES_KEPT = 8


# --- the engine's side ------------------------------------------------------------------------


@dataclass
class _Ask:
    prompt_ids: list[int]
    max_tokens: int  # the turn's limit, a cut turn's tokens included
    key: tuple[int, int]  # (the episode's sample key, its request number): the turn's seed
    logprobs: bool
    answer: asyncio.Future  # on the gateway's loop
    loop: asyncio.AbstractEventLoop
    cut: CutTurn = EMPTY_TURN  # the turn's tokens earlier rounds sampled


@dataclass(frozen=True)
class Answered:
    """A turn the engine sampled whole: its tokens, each with its version and logprob (0.0 where the engine
    was not asked for them), and whether it ended with the end-of-turn token."""

    turn: CutTurn
    ended: bool


_WAKE = object()  # an episode ended: the round may be over


class EngineRefused(RequestError):
    """A turn the engine would not take (its submit raised): answered 400, and its episode ends counted."""


class EngineTurns:
    """The queue between the routes and the engine: `ask` (on the loop) queues a turn, `pump` (in the
    engine's thread) submits what is queued, steps the engine and answers each finished turn.

    A batch's episodes are served from `open` until each one's `end`: a turn asked outside that is answered
    503 at once, never left in a queue nobody pumps (a harness's leftover task calling after its episode
    ended). Several batches may be open at once, each between its rounds (partial rollout): a pump serves
    its own batch's turns and keeps the others' for theirs."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # `ask`'s check and put against `end`
        self._running: set[int] = set()  # sample keys of the episodes whose harness has not ended
        self._held: list[_Ask] = []  # turns for a later pump: cut ones, asked with the budget spent, another batch's
        self.waiting = 0  # turns asked and not answered
        # The engine's own record: each sample key's turns as the engine sampled them (a cut turn whole), in
        # order, read to check that the dock holds exactly these (the exactness measure).
        self.sampled: dict[int, list[list[int]]] = {}

    def open(self, keys: Iterable[int]) -> None:
        """Serve the turns of the episodes of sample `keys` (a batch about to run; `pump` follows)."""
        with self._lock:
            for key in keys:
                self._running.add(key)
                self.sampled.pop(key, None)

    def end(self, key: int) -> None:
        """Episode `key`'s harness has ended: a turn it asks from now is answered 503 (from any thread)."""
        with self._lock:
            self._running.discard(key)
        self._queue.put(_WAKE)

    def running(self) -> set[int]:
        """The sample keys of the episodes whose harness has not ended."""
        with self._lock:
            return set(self._running)

    def ask(self, prompt_ids: list[int], *, max_tokens: int, key: tuple[int, int], logprobs: bool) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        with self._lock:
            if key[0] not in self._running:
                raise _over()
            self.waiting += 1
            answer.add_done_callback(self._answered)
            self._queue.put(_Ask(prompt_ids, max_tokens, key, logprobs, answer, loop))
        return answer

    def _answered(self, _future: asyncio.Future) -> None:
        self.waiting -= 1

    def pump(
        self,
        engine: VllmRolloutEngine,
        *,
        keys: Collection[int],
        eos_token_id: int,
        seed: int,
        greedy: bool = False,
        budget: RoundBudget | None = None,
    ) -> tuple[bool, float]:
        """Serve the turns of the episodes of sample `keys` until every one has ended, or, in a round with a
        token budget (`budget`, chat/cut_turns.py), until every one still running has spent it: (whether every
        one has ended, the seconds spent in engine steps). A turn the budget cut, and one asked with the
        budget spent, wait for the next pump of `keys`, which resumes the cut turn from its tokens. A turn
        whose asker went away (a cancelled request) is aborted in the engine, never left to run into the
        next call."""
        budget = budget if budget is not None else RoundBudget(None)
        mine = set(keys)
        running: dict[str, _Ask] = {}
        engine_s = 0.0
        asks, self._held = self._held, []  # the last round's first
        while True:
            # Taken before the queue is read: a turn asked before its episode's end is in the queue by then.
            live = self.running() & mine
            idle = not (running or asks) and bool(live) and not _round_over(budget, live)
            items = [self._queue.get()] if idle else []  # nothing to do until a turn is asked or a harness ends
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            asks += [item for item in items if item is not _WAKE]
            for ask in asks:  # one by one: a turn the engine refuses fails its own request only
                sample = ask.key[0]
                if ask.answer.done():  # its asker went away while it waited
                    continue
                if sample not in mine:  # another batch's, between its rounds; or a leftover of one that ended
                    if sample in self.running():
                        self._held.append(ask)
                    else:
                        ask.loop.call_soon_threadsafe(_fail, ask.answer, _over())
                    continue
                if not budget.has_budget(sample):
                    self._held.append(ask)
                    continue
                request = budget.request(
                    sample, prompt_ids=ask.prompt_ids, turn_limit=ask.max_tokens, key=ask.key, cut=ask.cut
                )
                try:
                    (request_id,) = engine.submit(
                        [request.prompt_ids],
                        max_tokens=[request.max_tokens],
                        eos_token_id=eos_token_id,
                        seed=seed,
                        request_keys=[request.key],
                        greedy=greedy,
                        logprobs=ask.logprobs,
                    )
                except ValueError as error:  # vLLM's check of a request (its length, its ids) before it queues it
                    refused = EngineRefused(f"the engine refused the turn: {error}", param="messages")
                    ask.loop.call_soon_threadsafe(_fail, ask.answer, refused)
                    continue
                running[request_id] = ask
            asks = []
            dropped = [request_id for request_id, ask in running.items() if ask.answer.done()]
            if dropped:
                engine.abort(dropped)
                for request_id in dropped:
                    running.pop(request_id)
            if running:
                started = time.perf_counter()
                finished = engine.step(eos_token_id)
                engine_s += time.perf_counter() - started
                for request_id, completion in finished:
                    ask = running.pop(request_id)
                    turn, stopped = budget.took(ask.key[0], completion, cut=ask.cut, turn_limit=ask.max_tokens)
                    if stopped:  # the round's budget cut it: its rest is the next round's
                        ask.cut = turn
                        self._held.append(ask)
                        continue
                    self.sampled.setdefault(ask.key[0], []).append(turn.token_ids)
                    ask.loop.call_soon_threadsafe(_answer, ask.answer, Answered(turn, completion.finished_with_eos))
            elif not live:
                # every harness of `keys` has ended: a turn of theirs still held (a leftover task's) gets no round
                left = [ask for ask in self._held if ask.key[0] in mine]
                self._held = [ask for ask in self._held if ask.key[0] not in mine]
                for ask in left:
                    ask.loop.call_soon_threadsafe(_fail, ask.answer, _over())
                return True, engine_s
            elif _round_over(budget, live):
                return False, engine_s


def _round_over(budget: RoundBudget, live: set[int]) -> bool:
    """A round with a budget is over once every episode still running (`live`) has spent it."""
    return budget.round_tokens is not None and not any(budget.has_budget(key) for key in live)


def _over() -> RequestError:
    return RequestError(
        "this episode's turns are over: the rollout has stopped serving its episodes (a harness called the "
        "model after its episode ended)",
        param=None,
        status=503,
        code="episode_over",
    )


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


def _answer(future: asyncio.Future, answered: Answered) -> None:
    if not future.done():
        future.set_result(answered)


# --- the sessions ---------------------------------------------------------------------------


@dataclass
class Episode:
    """One episode's place in the gateway: its key, its session and what its harness posted."""

    key: int  # the sample's key (its turns' seeds)
    token: str  # the bearer token that opens this session
    session: Session
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    requests: int = 0  # engine requests made (each turn's seed key)
    rewards: list[float] = field(default_factory=list)  # POST .../reward, in order
    # each posted reward's turn: (segment, turn) of the model turn answered last before it (None: before any)
    reward_turns: list[tuple[int, int] | None] = field(default_factory=list)
    resends: int = 0  # requests answered from the record
    tool_calls: int = 0  # calls in the answers given
    refused: int = 0  # turns the engine refused (EngineRefused)
    in_flight: int = 0  # its requests being served or waiting for the lock
    # each Responses API answer's conversation (its input and output), for previous_response_id
    responses: dict[str, list[dict]] = field(default_factory=dict)


class Gateway:
    """The routes over the episodes open on it (`open`, `close`); `app()` is the ASGI application."""

    def __init__(
        self,
        *,
        shaper: Shaper,
        renderer: Callable[[Sequence[dict]], ChatRenderer],
        turns: EngineTurns,
        prompt_capacity: int,
        response_capacity: int,
        max_waiting: int,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_requests_per_episode: int = MAX_REQUESTS_PER_EPISODE,
        body_timeout_s: float = BODY_TIMEOUT_S,
        keep_logprobs: bool = False,
    ):
        """`keep_logprobs`: ask the engine for every sampled token's logprob whatever a request asks (partial
        rollout: the old-logprob pass keeps those of the tokens an older version sampled)."""
        self.shaper, self.renderer, self.turns = shaper, renderer, turns
        self.keep_logprobs = keep_logprobs
        self.prompt_capacity, self.response_capacity = prompt_capacity, response_capacity
        self.max_waiting, self.max_body_bytes = max_waiting, max_body_bytes
        self.max_requests_per_episode, self.body_timeout_s = max_requests_per_episode, body_timeout_s
        self._render_threads = concurrent.futures.ThreadPoolExecutor(
            RENDER_THREADS, thread_name_prefix="gateway-render"
        )
        self.episodes: dict[str, Episode] = {}
        self.mounts: list[Callable[[FastAPI], None]] = []  # routes served beside the sessions' (dispatch.py)

    def open(self, name: str, *, key: int) -> Episode:
        episode = Episode(key=key, token=secrets.token_urlsafe(24), session=Session(self.renderer))
        self.episodes[name] = episode
        return episode

    def close(self, name: str) -> Episode:
        return self.episodes.pop(name)

    def shutdown(self) -> None:
        """Stop the render threads (after the gateway's loop has stopped serving)."""
        self._render_threads.shutdown(wait=True, cancel_futures=True)

    async def _off_loop(self, function: Callable[..., Any], *args: Any) -> Any:
        """`function(*args)` on a render thread, the loop free meanwhile."""
        call = functools.partial(function, *args)
        return await asyncio.get_running_loop().run_in_executor(self._render_threads, call)

    # --- what a turn may sample ---

    def _check_fits(self, messages: Sequence[dict]) -> None:
        """Refuse, before anything is rendered, messages that cannot fit the episode's context whatever the
        template makes of them: more text than `TEXT_SLACK` times the context at the vocabulary's longest
        token, or more messages than the context has tokens. Every message is in the prompt, either held from
        an earlier turn or rendered now, so a request past either bound is past the context."""
        context = self.prompt_capacity + self.response_capacity
        where = (
            f"({self.prompt_capacity} prompt + {self.response_capacity} response tokens: data.max_prompt_length "
            "and algorithm.max_response_length)"
        )
        if len(messages) > context:
            raise RequestError(
                f"messages holds {len(messages)} messages, more than the {context} tokens of the episode's context "
                f"{where}, each message at least one; shorten it",
                param="messages",
                code="context_length_exceeded",
            )
        chars = sum(_text_chars(message.get("content")) for message in messages)
        limit = TEXT_SLACK * self.shaper.token_chars * context
        if chars > limit:
            raise RequestError(
                f"the messages' text is {chars} characters, past the limit of {limit}: the episode's context {where} "
                f"at {self.shaper.token_chars} characters a token (the vocabulary's longest), {TEXT_SLACK} times "
                "over; shorten it",
                param="messages",
                code="context_length_exceeded",
            )

    def _max_tokens(self, session: Session, plan: Plan, asked: int | None) -> int:
        """The turn's limit: what the segment's row leaves (the dock's response width, past a prompt
        longer than its prompt width), at most what the request asked."""
        if plan.reason is None:
            segment = session.segments[-1]
            prompt, response = len(segment.prompt_ids), len(segment.response_ids) + len(plan.added)
        else:
            prompt, response = len(plan.prompt_ids), 0
        left = self.response_capacity - max(0, prompt - self.prompt_capacity) - response
        if left < 1:
            raise RequestError(
                f"the conversation is {len(plan.prompt_ids)} tokens, which leaves no token to sample in the "
                f"episode's context ({self.prompt_capacity} prompt + {self.response_capacity} response tokens: "
                "data.max_prompt_length and algorithm.max_response_length); shorten it",
                param="messages",
                code="context_length_exceeded",
            )
        return left if asked is None else min(left, asked)

    async def _sample(self, episode: Episode, plan: Plan, *, asked: int | None, logprobs: bool) -> tuple[Turn, CutTurn]:
        """The turn as answered (its logprobs where the request asked for them), and its tokens as sampled,
        each with its version and logprob, for the session."""
        limit = self._max_tokens(episode.session, plan, asked)
        if self.turns.waiting >= self.max_waiting:
            raise RequestError(
                f"{self.turns.waiting} turns are waiting for the engine, its limit; retry",
                param=None,
                status=429,
                code="rate_limit_exceeded",
            )
        episode.requests += 1
        try:
            answered = await self.turns.ask(
                plan.prompt_ids,
                max_tokens=limit,
                key=(episode.key, episode.requests),
                logprobs=logprobs or self.keep_logprobs,
            )
        except EngineRefused:
            episode.refused += 1
            raise
        tokens = answered.turn
        return Turn(plan.prompt_ids, tokens.token_ids, tokens.logprobs if logprobs else None, answered.ended), tokens

    async def _once(self, episode: Episode, body: Any, turn: Callable[[], Coroutine[Any, Any, dict]]) -> dict:
        """`turn()`'s answer; a resend of an answered body gets the recorded answer. Called under the episode's
        lock (the route holds it from reading the body)."""
        assert episode.lock.locked(), "a turn is served under its episode's lock"
        digest = request_digest(body)
        recorded = episode.session.recorded(digest)
        if recorded is not None:
            episode.resends += 1
            return recorded
        answer = await turn()
        episode.session.record(digest, answer)
        return answer

    async def _chat_turn(self, episode: Episode, request: ChatRequest) -> tuple[Turn, dict, int]:
        """A chat turn of `request`, sampled and committed to the episode's session: the turn, its assistant
        message and its number in the episode (under the episode's lock)."""
        try:  # rendering and tokenizing, on a render thread
            plan = await self._off_loop(episode.session.plan, request.messages, request.tools)
        except ValueError as error:
            raise RequestError(f"messages: {error}", param="messages") from error
        sampled, tokens = await self._sample(episode, plan, asked=request.max_tokens, logprobs=request.logprobs)
        number = sum(s.turns for s in episode.session.segments) + 1
        prefix = f"call-{episode.key}-{number}"
        message = self.shaper.message(sampled, call_prefix=prefix, tool_calls=request.tool_calls)
        _commit(episode, plan, sampled, tokens, message)
        episode.tool_calls += len(message.get("tool_calls") or [])
        return sampled, message, number

    async def chat(self, episode: Episode, body: Any) -> dict:
        """A chat turn's answer (under the episode's lock, as `_once`)."""
        request = chat_request(body, served=self.shaper.served)
        self._check_fits(request.messages)

        async def turn() -> dict:
            sampled, message, number = await self._chat_turn(episode, request)
            return self.shaper.chat_completion(sampled, message, answer_id=f"chatcmpl-{episode.key}-{number}")

        return await self._once(episode, body, turn)

    async def respond(self, episode: Episode, body: Any) -> dict:
        """A Responses API turn's answer (gateway/responses.py; under the episode's lock, as `_once`). The
        conversation it ends, its answer included, is kept for a later request's previous_response_id."""
        request = responses_request(body, served=self.shaper.served, previous=episode.responses.get)
        self._check_fits(request.chat.messages)

        async def turn() -> dict:
            sampled, message, number = await self._chat_turn(episode, request.chat)
            answer_id = f"resp-{episode.key}-{number}"
            episode.responses[answer_id] = [*request.conversation, message]
            while len(episode.responses) > RESPONSES_KEPT:  # the oldest first: a harness continues its latest
                del episode.responses[next(iter(episode.responses))]
            return response(sampled, message, answer_id=answer_id, model=self.shaper.model, request=request)

        return await self._once(episode, body, turn)

    async def complete(self, episode: Episode, body: Any) -> dict:
        """A completion's answer (under the episode's lock, as `_once`)."""
        prompt, asked = completion_prompt(body, served=self.shaper.served, vocab_size=self.shaper.vocab_size)

        async def turn() -> dict:
            plan = await self._off_loop(episode.session.plan_ids, prompt)
            sampled, tokens = await self._sample(episode, plan, asked=asked, logprobs=body.get("logprobs") is not None)
            number = sum(s.turns for s in episode.session.segments) + 1
            _commit(
                episode, plan, sampled, tokens, {"role": "assistant", "content": self.shaper.text(sampled.token_ids)}
            )
            return self.shaper.completion(sampled, answer_id=f"cmpl-{episode.key}-{number}")

        return await self._once(episode, body, turn)

    # --- HTTP ---

    def app(self) -> FastAPI:
        app = FastAPI(title="rldock gateway", docs_url=None, redoc_url=None, openapi_url=None)

        def refused(error: RequestError) -> JSONResponse:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
            if error.status == 408:  # the rest of its body is not worth waiting for
                headers = {"Connection": "close"}
            return JSONResponse(error.body(), status_code=error.status, headers=headers)

        def opened(name: str, request: Request) -> Episode:
            episode = self.episodes.get(name)
            sent = request.headers.get("authorization", "")
            token = sent.removeprefix("Bearer ").strip() if sent.startswith("Bearer ") else ""
            if episode is None or not secrets.compare_digest(token.encode(), episode.token.encode()):
                raise RequestError(
                    "no session here opens with this key: each episode's key opens its own session only",
                    param=None,
                    status=401,
                    code="invalid_api_key",
                )
            return episode

        async def body_of(request: Request, *, limit: int) -> Any:
            try:
                raw = await read_body(request, limit=limit, timeout_s=self.body_timeout_s)
            except BodyUnread as error:
                raise RequestError(str(error), param=None, status=error.status) from error
            try:
                return json.loads(raw)
            except (ValueError, RecursionError) as error:
                raise RequestError(f"the body is not JSON: {error}", param=None) from error

        @contextlib.asynccontextmanager
        async def admitted(episode: Episode, request: Request, *, limit: int) -> AsyncIterator[None]:
            """The request as one of the episode's in flight, at most `max_requests_per_episode` (429 past them);
            a body declared past `limit` is refused first, before it waits for anything."""
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise RequestError(f"the body is {declared} bytes, past the limit of {limit}", param=None)
            if episode.in_flight >= self.max_requests_per_episode:
                raise RequestError(
                    f"{episode.in_flight} requests of this episode are in flight, its limit (one is served at a "
                    "time, the others wait their turn); retry",
                    param=None,
                    status=429,
                    code="rate_limit_exceeded",
                )
            episode.in_flight += 1
            try:
                yield
            finally:
                episode.in_flight -= 1

        def route(handler: Callable[[Episode, Any], Coroutine[Any, Any, dict]], stream=stream_chunks):
            async def serve(name: str, request: Request):
                try:
                    episode = opened(name, request)
                    async with admitted(episode, request, limit=self.max_body_bytes), episode.lock:  # read in its turn
                        body = await body_of(request, limit=self.max_body_bytes)
                        answer = await handler(episode, body)
                except RequestError as error:
                    return refused(error)
                if isinstance(body, dict) and body.get("stream"):
                    return StreamingResponse(stream(answer), media_type="text/event-stream")
                return JSONResponse(answer)

            return serve

        app.post("/sessions/{name}/v1/chat/completions")(route(self.chat))
        app.post("/sessions/{name}/v1/completions")(route(self.complete))
        app.post("/sessions/{name}/v1/responses")(route(self.respond, stream=stream_events))

        @app.post("/sessions/{name}/reward")
        async def reward(name: str, request: Request):
            try:
                episode = opened(name, request)
                async with admitted(episode, request, limit=MAX_REWARD_BODY_BYTES):
                    body = await body_of(request, limit=MAX_REWARD_BODY_BYTES)
                value = body.get("reward") if isinstance(body, dict) else None
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise RequestError("reward is not a finite number", param="reward")
                if abs(value) > REWARD_LIMIT:
                    raise RequestError(f"reward {value} is past ±{REWARD_LIMIT:g}", param="reward")
            except RequestError as error:
                return refused(error)
            episode.rewards.append(float(value))
            episode.reward_turns.append(episode.session.latest_turn())
            return JSONResponse({"rewards": len(episode.rewards)})

        @app.get("/sessions/{name}/v1/models")
        async def models(name: str, request: Request):
            try:
                opened(name, request)
            except RequestError as error:
                return refused(error)
            return JSONResponse(
                {"object": "list", "data": [{"id": self.shaper.model, "object": "model", "owned_by": "rldock"}]}
            )

        @app.get("/health")
        async def health():
            return {"status": "healthy"}

        for mount in self.mounts:
            mount(app)
        return app


def _commit(episode: Episode, plan: Plan, sampled: Turn, tokens: CutTurn, answer: dict) -> None:
    """A sampled turn into the episode's session: its ids, each one's version and logprob, and the answer given."""
    episode.session.commit(
        plan,
        tokens.token_ids,
        ended_turn=sampled.ended,
        answer=answer,
        versions=tokens.versions,
        logprobs=tokens.logprobs,
    )


def _text_chars(content: Any) -> int:
    """The characters of a message's text as the session will read it (content_text): a string's, or its text
    parts'; 0 for anything else (refused later, when it is read)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(part["text"]) for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return 0


class GatewayLoop:
    """An event loop in a thread of its own serving `gateway` on `host`:`port` (127.0.0.1 and a port the
    kernel picks for a harness of the actor's own; every address and the contract's port for agent pods);
    `run(coro)` runs a coroutine there (the harnesses). Its connections are capped and timed
    (connections.py). Closed with `close`."""

    def __init__(
        self,
        gateway: Gateway,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_connections: int | None = None,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ):
        """`max_connections`: None is `connections.connection_cap()` (MAX_CONNECTIONS, at most half the
        descriptors); a request's body deadline is the gateway's `body_timeout_s`."""
        import uvicorn

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self._thread.start()
        self._socket = socket.create_server((host, port))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        self.max_connections = connection_cap() if max_connections is None else max_connections
        protocol = guarded_protocol(
            max_connections=self.max_connections,
            header_timeout_s=header_timeout_s,
            body_timeout_s=gateway.body_timeout_s,
        )
        config = uvicorn.Config(
            gateway.app(),
            loop="asyncio",
            http=protocol,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        )
        self._server = uvicorn.Server(config)
        self._serving = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[self._socket]), self.loop)
        self.run(self._started()).result()

    async def _started(self) -> None:
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    def base_url(self, name: str) -> str:
        return f"{self.url}/sessions/{name}/v1"

    def run(self, coroutine: Coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            self._serving.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
        self._socket.close()
