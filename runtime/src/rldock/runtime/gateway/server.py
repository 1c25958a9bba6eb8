"""The gateway's HTTP side: per-episode OpenAI-compatible routes, each turn one request of the rollout
engine that every other episode's turns share.

Routes (each episode's base URL is `http://<host>:<port>/sessions/<episode>/v1`, its key the bearer token
that opens that session only):

- `POST /sessions/<episode>/v1/chat/completions`: a chat turn (`stream: true` answers as server-sent
  events); the session (sessions.py) turns the messages into the exact ids the engine continues.
- `POST /sessions/<episode>/v1/completions`: a prompt of token ids, continued as is (a harness that
  renders its own prompts); an extension of the held ids extends the segment, any other prompt opens one.
- `GET /sessions/<episode>/v1/models`: the one model served.
- `POST /sessions/<episode>/reward`: `{"reward": x}`, a reward for the episode's latest step.
- `GET /health`.

Limits, each refusal OpenAI's error body naming the field: a body past `max_body_bytes`, `n` other than 1,
another model's name, a prompt the episode's context cannot continue (400); more turns waiting for the
engine than `max_waiting` (429 with Retry-After); a wrong key or an episode not open here (401, the same
answer for both); a turn asked after its episode's harness ended (503: the episode is over);
a turn the engine refuses (400 with the engine's reason; its episode ends `engine_refused`). A request's
sampling settings are the job's (rollout.temperature, top_p): a turn is
sampled exactly as rldock's own loop samples one.

Rounds (rollout.partial_rollout resume): the engine may be pumped in rounds with a weight update between
them (`EngineTurns.pump` with a `RoundBudget`, agent/cut_turns.py). In a round with a token budget an episode
samples at most that many tokens; the turn being sampled when it reaches them is cut there, kept with each
token's version and logprob, and its rest is sampled from those tokens in the next round on the new
weights. Its HTTP request stays open meanwhile and gets one answer, the whole turn: a harness never sees a
cut. A round ends once every episode still running has spent its budget (a turn it asks then waits for the
next round); the harnesses go on running between rounds, their sessions open.

Concurrency: the routes run on the gateway's event loop (a thread of its own, `GatewayLoop`), the engine in
the rollout's thread (`EngineTurns.pump`), which is the one thread that calls it; a turn crosses between
them through a queue one way and `call_soon_threadsafe` the other. One request of an episode is sampled at
a time (its session's lock), so a session's bookkeeping never interleaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Collection, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rldock.runtime.agent.conversation import ChatRenderer
from rldock.runtime.agent.cut_turns import EMPTY_TURN, CutTurn, RoundBudget
from rldock.runtime.agent.interfaces import REWARD_LIMIT
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.gateway.answers import (
    RequestError,
    Shaper,
    Turn,
    chat_request,
    completion_prompt,
    stream_chunks,
)
from rldock.runtime.gateway.sessions import Plan, Session, request_digest

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20  # a request's body: a long conversation fits, a flood does not
RETRY_AFTER_S = 1


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
        token budget (`budget`, agent/cut_turns.py), until every one still running has spent it: (whether every
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
    resends: int = 0  # requests answered from the record
    tool_calls: int = 0  # calls in the answers given
    refused: int = 0  # turns the engine refused (EngineRefused)


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
        keep_logprobs: bool = False,
    ):
        """`keep_logprobs`: ask the engine for every sampled token's logprob whatever a request asks (partial
        rollout: the old-logprob pass keeps those of the tokens an older version sampled)."""
        self.shaper, self.renderer, self.turns = shaper, renderer, turns
        self.keep_logprobs = keep_logprobs
        self.prompt_capacity, self.response_capacity = prompt_capacity, response_capacity
        self.max_waiting, self.max_body_bytes = max_waiting, max_body_bytes
        self.episodes: dict[str, Episode] = {}
        self.mounts: list[Callable[[FastAPI], None]] = []  # routes served beside the sessions' (dispatch.py)

    def open(self, name: str, *, key: int) -> Episode:
        episode = Episode(key=key, token=secrets.token_urlsafe(24), session=Session(self.renderer))
        self.episodes[name] = episode
        return episode

    def close(self, name: str) -> Episode:
        return self.episodes.pop(name)

    # --- what a turn may sample ---

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
        """`turn()`'s answer under the episode's lock; a resend of an answered body gets the recorded answer."""
        digest = request_digest(body)
        async with episode.lock:
            recorded = episode.session.recorded(digest)
            if recorded is not None:
                episode.resends += 1
                return recorded
            answer = await turn()
            episode.session.record(digest, answer)
            return answer

    async def chat(self, episode: Episode, body: Any) -> dict:
        request = chat_request(body, model=self.shaper.model)

        async def turn() -> dict:
            try:
                plan = episode.session.plan(request.messages, request.tools)
            except ValueError as error:
                raise RequestError(f"messages: {error}", param="messages") from error
            sampled, tokens = await self._sample(episode, plan, asked=request.max_tokens, logprobs=request.logprobs)
            number = sum(s.turns for s in episode.session.segments) + 1
            message = self.shaper.message(sampled, call_prefix=f"call-{episode.key}-{number}")
            episode.session.commit(
                plan,
                tokens.token_ids,
                ended_turn=sampled.ended,
                answer=message,
                versions=tokens.versions,
                logprobs=tokens.logprobs,
            )
            episode.tool_calls += len(message.get("tool_calls") or [])
            return self.shaper.chat_completion(sampled, message, answer_id=f"chatcmpl-{episode.key}-{number}")

        return await self._once(episode, body, turn)

    async def complete(self, episode: Episode, body: Any) -> dict:
        prompt, asked = completion_prompt(body, model=self.shaper.model, vocab_size=self.shaper.vocab_size)

        async def turn() -> dict:
            plan = episode.session.plan_ids(prompt)
            sampled, tokens = await self._sample(episode, plan, asked=asked, logprobs=body.get("logprobs") is not None)
            number = sum(s.turns for s in episode.session.segments) + 1
            answer = {"role": "assistant", "content": self.shaper.text(sampled.token_ids)}
            episode.session.commit(
                plan,
                tokens.token_ids,
                ended_turn=sampled.ended,
                answer=answer,
                versions=tokens.versions,
                logprobs=tokens.logprobs,
            )
            return self.shaper.completion(sampled, answer_id=f"cmpl-{episode.key}-{number}")

        return await self._once(episode, body, turn)

    # --- HTTP ---

    def app(self) -> FastAPI:
        app = FastAPI(title="rldock gateway", docs_url=None, redoc_url=None, openapi_url=None)

        def refused(error: RequestError) -> JSONResponse:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
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

        async def body_of(request: Request) -> Any:
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                raise RequestError(f"the body is {declared} bytes, past the limit of {self.max_body_bytes}", param=None)
            raw = bytearray()
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > self.max_body_bytes:
                    raise RequestError(f"the body is past the limit of {self.max_body_bytes} bytes", param=None)
            try:
                return json.loads(raw)
            except (ValueError, RecursionError) as error:
                raise RequestError(f"the body is not JSON: {error}", param=None) from error

        def route(handler: Callable[[Episode, Any], Coroutine[Any, Any, dict]]):
            async def serve(name: str, request: Request):
                try:
                    episode = opened(name, request)
                    body = await body_of(request)
                    answer = await handler(episode, body)
                except RequestError as error:
                    return refused(error)
                if isinstance(body, dict) and body.get("stream"):
                    return StreamingResponse(stream_chunks(answer), media_type="text/event-stream")
                return JSONResponse(answer)

            return serve

        app.post("/sessions/{name}/v1/chat/completions")(route(self.chat))
        app.post("/sessions/{name}/v1/completions")(route(self.complete))

        @app.post("/sessions/{name}/reward")
        async def reward(name: str, request: Request):
            try:
                episode = opened(name, request)
                body = await body_of(request)
                value = body.get("reward") if isinstance(body, dict) else None
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                    raise RequestError("reward is not a finite number", param="reward")
                if abs(value) > REWARD_LIMIT:
                    raise RequestError(f"reward {value} is past ±{REWARD_LIMIT:g}", param="reward")
            except RequestError as error:
                return refused(error)
            episode.rewards.append(float(value))
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


class GatewayLoop:
    """An event loop in a thread of its own serving `gateway` on `host`:`port` (127.0.0.1 and a port the
    kernel picks for a harness of the actor's own; every address and the contract's port for agent pods);
    `run(coro)` runs a coroutine there (the harnesses). Closed with `close`."""

    def __init__(self, gateway: Gateway, *, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self._thread.start()
        self._socket = socket.create_server((host, port))
        self.url = f"http://{host}:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(
            gateway.app(), loop="asyncio", lifespan="off", log_config=None, log_level="warning", access_log=False
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
