"""The multi-turn rollout: episodes in which the policy generates, calls tools, reads their results
and goes on, each ending as one sample of the transfer dock.

One episode per sample. A turn is one engine request (the prompt plus the trajectory so far); it
ends at the model's EOS. A turn with tool calls (agent.tool_call_format) gets the tools' results as
`tool` messages and the next turn; a turn without one is the final answer, which the environment
(if any) may answer with a `user` message and another turn. An episode ends at a final answer the
environment accepts (or any final answer without one), after agent.max_turns turns, or when
algorithm.max_response_length, which counts every token after the prompt, is used up: a message
that would leave the model no token to answer is not added.

With an environment each episode is a session of it (agent/interfaces.py): opened and reset before the
episode's first turn, stepped with every turn that ends without a tool call, closed on every path.
The prompt then ends before the generation prompt, and the response opens with the reset's message
(if any) as a `user` message and the generation prompt, tokens the model did not sample. A step's
reward is kept per turn (`Episode.rewards`); its message is the next `user` message; `done` ends the
episode. A session that fails, times out or finds no replica ends its episode with a counted reason
(`ended`) and the others go on; an environment of the actor's own process that raises stops the job
(a bug in its code, named), as does a service none of whose replicas answered for
`servers.unavailable_timeout_s` (EnvironmentUnavailable). An episode that has run
agent.episode_timeout_s takes no further turn: when the answer to its turn arrives (the step that turn
took is kept, with its reward) it ends `episode_timeout`, so it lasts at most that plus one turn and one
answer (agent.tool_timeout_s); it is trained on as it stands, its session closed then and never before.

The engine is never idle on a tool or an environment: turns of all episodes share one engine, the
tools and sessions run as coroutines on an event loop in a thread of their own, and the loop steps
the engine for the other episodes while calls are out; it blocks on them only when no request is
left to generate.

Each episode's seed is mixed from (engine seed, iteration, sample key, turn), its environment's reset
seed from (engine seed, iteration, sample key): a resumed iteration, or the same sample on another
rank, samples the same turns given the same tool results and observations.

Rounds (partial rollout, rollout.partial_rollout resume): a rollout can run in rounds with a weight
update between them (`start`, then `advance` once per round). In a round with a token budget an episode
stops once it has sampled that many tokens: the turn being sampled is cut there and its rest is sampled
in the next round on the new weights, from the cut tokens; tool calls and environment steps that are out
go on running between rounds, and every session stays open until its episode ends. A cut episode keeps
its session place (Environment.max_sessions) across the update, so a round ends once the episodes still
waiting for a place are all that is left: they start in the next round, when places come free. No episode is cut
short or dropped: each one's tokens keep the policy version that sampled them and their logprob then
(`Episode.token_version`, `Episode.logprobs`), which the update's importance ratio reads. The cut and the
resume are chat/cut_turns.py's, which a harness's turns through the gateway run too.

Carried rollouts (rollout/carry.py): a round may also end on a condition of the caller's (`advance`'s
`until`, checked as episodes end): from then no further turn is submitted, the turns being sampled run to
their ends, and episodes with a turn to sample wait for the next round. Such a rollout lives across
iterations: `admit` adds episodes to it between rounds and `remove` takes the ended ones out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from rldock.config.agent import AgentSpec
from rldock.runtime.agent.interfaces import (
    REWARD_LIMIT,
    Environment,
    EnvironmentProtocolError,
    EnvironmentSession,
    EnvironmentUnavailable,
    EpisodeContext,
    Observation,
    SessionFailed,
    Tool,
    ToolResult,
)
from rldock.runtime.chat.conversation import ChatRenderer, plain_ids
from rldock.runtime.chat.cut_turns import EMPTY_TURN, CutTurn, RoundBudget
from rldock.runtime.chat.parsers import ParsedTurn, ToolCallParser
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine, mixed_seed

logger = logging.getLogger(__name__)


@dataclass
class Episode:
    """One sample's trajectory: every token after the prompt, and which of them the model sampled."""

    prompt: list[int]
    key: int  # the sample's stable id, for its turns' seeds
    context: EpisodeContext | None  # what the environment checks the answer against
    response: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)  # 1: sampled by the model (trained on)
    turn_index: list[int] = field(default_factory=list)  # per token: the model turn it is of, -1 if not the model's
    turns: int = 0
    final_text: str = ""  # the model's last turn, decoded
    tool_calls: Counter[str] = field(default_factory=Counter)  # per tool name
    tool_errors: Counter[str] = field(default_factory=Counter)  # per tool name ("malformed", "unknown")
    tool_seconds: dict[str, float] = field(default_factory=dict)  # per tool name
    tool_counts: Counter[str] = field(default_factory=Counter)  # the tools' own counts (ToolResult.counts)
    ended: str = ""  # answer | max_turns | length | environment_<timeout|error|protocol_error|unavailable> |
    # observation_too_long | episode_timeout
    session: EnvironmentSession | None = None  # open while the episode runs with an environment
    rewards: list[float] = field(default_factory=list)  # the environment's per step (0.0 where it gave none)
    turn_rewards: list[float] = field(default_factory=list)  # per model turn: its step's reward (0.0 without one)
    step_seconds: list[float] = field(default_factory=list)  # each reset and step's wait
    # per token: the policy version that sampled it (-1 where the model did not) and its logprob then (0.0
    # where the model did not, or logprobs were not asked for)
    token_version: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cut: CutTurn | None = None  # the turn a round's budget stopped, resumed in the next round
    finished: bool = False  # it has ended and takes no further turn (its session closing or closed)
    # for agent.episode_timeout_s: when its session opened (past the wait for a place), else when created
    started: float = field(default_factory=time.perf_counter)

    def add(
        self,
        ids: Sequence[int],
        *,
        model: bool,
        versions: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
    ) -> None:
        """Append tokens after the prompt; the model's are a new turn (one call per turn), each token
        with the version that sampled it (`versions`, default -1) and its logprob then (default 0.0)."""
        self.response.extend(ids)
        self.model_mask.extend([int(model)] * len(ids))
        if model:
            self.turn_rewards.append(0.0)
        self.turn_index.extend([len(self.turn_rewards) - 1 if model else -1] * len(ids))
        self.token_version.extend(versions if versions is not None else [-1] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    @property
    def num_sampled_tokens(self) -> int:
        """Tokens the model sampled so far, a cut turn's included."""
        return sum(self.model_mask) + (len(self.cut.token_ids) if self.cut is not None else 0)

    @property
    def num_tool_calls(self) -> int:
        return sum(self.tool_calls.values())

    @property
    def num_tool_errors(self) -> int:
        return sum(self.tool_errors.values())


@dataclass
class Rollout:
    """The episodes of one `AgentLoop` rollout between rounds (agent/episode_loop.py's module docstring,
    "Rounds"): what is still out for them (tool calls and environment steps, which go on running between
    rounds) and which have a turn to sample in the next round. Their sessions stay open until each ends."""

    episodes: list[Episode]
    seed: int
    greedy: bool
    out: dict[concurrent.futures.Future, int] = field(default_factory=dict)  # answers still out -> episode
    waiting: list[int] = field(default_factory=list)  # episodes with a turn to sample
    rounds: int = 0  # rounds run

    @property
    def done(self) -> bool:
        return not self.out and not self.waiting

    def remove(self, ended: Sequence[Episode]) -> None:
        """Take the `ended` episodes out (a carried rollout's, once written); the others keep their places
        in `out` and `waiting`."""
        gone = {id(episode) for episode in ended}
        assert all(episode.finished for episode in ended), "only ended episodes leave a rollout"
        kept = [i for i, episode in enumerate(self.episodes) if id(episode) not in gone]
        position = {old: new for new, old in enumerate(kept)}
        self.episodes = [self.episodes[i] for i in kept]
        self.out = {future: position[index] for future, index in self.out.items()}
        self.waiting = [position[index] for index in self.waiting]


# What a turn's tools or the environment answered: the messages, and each call's (tool, error, seconds,
# the tool's own counts).
@dataclass(frozen=True)
class Answers:
    messages: list[dict]
    calls: list[tuple[str, bool, float, Mapping[str, int]]] = field(default_factory=list)
    ended: str = ""  # why the environment ended the episode: "answer" (done), "environment_timeout", ...
    kind: str = "tools"  # tools | reset (rendered after the prompt, not after a model turn) | step
    reward: float | None = None  # an environment step's reward (a reset's is not kept)
    seconds: float = 0.0  # the environment's wait


MALFORMED, UNKNOWN = "malformed", "unknown"  # tool-error keys of calls that named no tool
EPISODE_TIMEOUT = "episode_timeout"  # why an episode past agent.episode_timeout_s ended


@dataclass
class LoopTiming:
    """Where one `AgentLoop.run`'s wall time went: generating (`engine_s`), generating while tool calls or
    environment steps were out (`engine_while_waiting_s`: the overlap), and blocked with nothing to
    generate until one answered (`blocked_s`)."""

    wall_s: float = 0.0
    engine_s: float = 0.0
    engine_while_waiting_s: float = 0.0
    blocked_s: float = 0.0


class AgentLoop:
    """Runs episodes on one engine with the job's tools, environment and tool-call parser."""

    def __init__(
        self,
        *,
        engine: VllmRolloutEngine,
        tokenizer,
        renderer: ChatRenderer,
        tools: Mapping[str, Tool],
        environment: Environment | None,
        parser: ToolCallParser,
        spec: AgentSpec,
        max_response_length: int,
    ):
        self.engine, self.tokenizer, self.renderer = engine, tokenizer, renderer
        self.tools, self.environment, self.parser, self.spec = dict(tools), environment, parser, spec
        self.max_response_length = max_response_length
        self.eos = tokenizer.eos_token_id
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agent-tools", daemon=True)
        self._thread.start()
        self._slots = asyncio.run_coroutine_threadsafe(self._make_slots(), self._loop).result()
        # Sessions the environment holds at once (Environment.max_sessions); an episode past them waits
        # for another's to close before its reset, outside the reset's time limit.
        self._admitted = asyncio.run_coroutine_threadsafe(self._make_admission(environment), self._loop).result()
        self._session_limit = None if environment is None else environment.max_sessions
        self._closing: list[concurrent.futures.Future] = []
        self.sessions_open = 0  # sessions opened and not yet closed (0 between rollouts)
        self.sessions_open_max = 0  # the most open at once in the last run
        self.timing = LoopTiming()  # the last run's

    async def _make_slots(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.spec.max_concurrent_tool_calls)  # bound to the tools' loop

    @staticmethod
    async def _make_admission(environment: Environment | None) -> asyncio.Semaphore | None:
        limit = None if environment is None else environment.max_sessions
        return None if limit is None else asyncio.Semaphore(limit)  # bound to the tools' loop

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()
        if self.environment is not None:
            self.environment.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    # --- the loop -----------------------------------------------------------------------------

    def run(
        self,
        prompts: Sequence[list[int]],
        keys: Sequence[int],
        contexts: Sequence[EpisodeContext | None],
        *,
        seed: int,
        greedy: bool = False,
    ) -> list[Episode]:
        """Episodes run to their ends in one round."""
        rollout = self.start(prompts, keys, contexts, seed=seed, greedy=greedy)
        self.advance(rollout)
        return rollout.episodes

    def start(
        self,
        prompts: Sequence[list[int]],
        keys: Sequence[int],
        contexts: Sequence[EpisodeContext | None],
        *,
        seed: int,
        greedy: bool = False,
    ) -> Rollout:
        """One episode per prompt: each one's session opening (its reset out) or, without an environment,
        its first turn waiting for `advance`."""
        rollout = Rollout([], seed, greedy)
        self.admit(rollout, prompts, keys, contexts)
        return rollout

    def admit(
        self,
        rollout: Rollout,
        prompts: Sequence[list[int]],
        keys: Sequence[int],
        contexts: Sequence[EpisodeContext | None],
    ) -> list[Episode]:
        """Add one episode per prompt to `rollout` (between its rounds), as `start` does; the new episodes.
        `keys` must be new to the rollout: they seed the episodes' turns and resets."""
        episodes = [Episode(list(p), key, context) for p, key, context in zip(prompts, keys, contexts)]
        first = len(rollout.episodes)
        rollout.episodes.extend(episodes)
        if self.environment is None:
            rollout.waiting.extend(range(first, first + len(episodes)))
        else:  # each episode's first turn waits for its session's reset, not for the others'
            for index, episode in enumerate(episodes, start=first):
                reset = self._open(
                    self.environment, episode, mixed_seed(self.engine.seed, rollout.seed, (episode.key,))
                )
                rollout.out[asyncio.run_coroutine_threadsafe(reset, self._loop)] = index
        return episodes

    def advance(
        self,
        rollout: Rollout,
        *,
        round_tokens: int | None = None,
        policy_version: int = 0,
        logprobs: bool = False,
        until: Callable[[], bool] | None = None,
    ) -> None:
        """One round of `rollout` on the engine's weights (`policy_version`): every episode runs until it
        ends or, with `round_tokens`, until it has sampled that many tokens in this round. A turn that
        reaches the budget is cut there (`Episode.cut`) and waits for the next round, which samples its
        rest; an episode whose budget is spent when its tools or its step answer waits too, and what is
        still out for it goes on running between rounds. Ended episodes' sessions are closed; the others'
        stay open. `logprobs`: keep each sampled token's logprob (Episode.logprobs). `until`: the round
        also ends once it holds (asked as episodes end): no further turn is submitted, the turns out run to
        their ends, and the episodes with a turn to sample wait for the next round."""
        episodes = rollout.episodes
        requests: dict[str, int] = {}  # engine request id -> episode
        budget = RoundBudget(round_tokens, policy_version)  # per episode index
        has_budget = budget.has_budget
        rollout.rounds += 1
        cut = False  # `until` held: the round submits no further turn

        def turn_limit(index: int) -> int:
            """A turn's tokens at most: what the episode's length leaves."""
            return self.max_response_length - len(episodes[index].response)

        def check_until() -> bool:
            nonlocal cut
            cut = cut or (until is not None and until())
            return cut

        def submit(indices: list[int]) -> None:
            if check_until():
                rollout.waiting.extend(indices)
                return
            rollout.waiting.extend(i for i in indices if not has_budget(i))
            go = [i for i in indices if has_budget(i)]
            asks = [
                budget.request(
                    i,
                    prompt_ids=episodes[i].prompt + episodes[i].response,
                    turn_limit=turn_limit(i),
                    key=(episodes[i].key, episodes[i].turns),  # a turn's stream: (sample, turn)
                    cut=episodes[i].cut or EMPTY_TURN,
                )
                for i in go
            ]
            ids = self.engine.submit(
                [ask.prompt_ids for ask in asks],
                max_tokens=[ask.max_tokens for ask in asks],
                eos_token_id=self.eos,
                seed=rollout.seed,
                request_keys=[ask.key for ask in asks],
                greedy=rollout.greedy,
                logprobs=logprobs,
            )
            requests.update(zip(ids, go))

        def can_go(future: concurrent.futures.Future, index: int) -> bool:
            """Whether what is out for episode `index` can still move this round: it has budget left and,
            in a round with a budget, is not a reset waiting for a session place that no episode of the
            round gives back (every place held: a cut episode keeps its place until the next round)."""
            if not has_budget(index):
                return False
            if round_tokens is None or self._session_limit is None or future.done():
                return True
            return episodes[index].session is not None or self.sessions_open < self._session_limit

        def runnable() -> bool:
            """A turn out, or an answer out that can move; a session still closing may free a place."""
            if check_until():
                return bool(requests)  # the turns out finish; nothing else moves this round
            if requests or any(can_go(future, index) for future, index in out.items()):
                return True
            closing = [future for future in self._closing if not future.done()]
            if not closing or not any(has_budget(index) for index in out.values()):
                return False
            concurrent.futures.wait(closing)  # its place goes to a waiting episode
            return any(can_go(future, index) for future, index in out.items())

        out = rollout.out
        timing = self.timing = LoopTiming()
        started = time.perf_counter()
        self.sessions_open_max = self.sessions_open
        try:
            waiting, rollout.waiting = rollout.waiting, []
            submit(waiting)
            while runnable():
                if self.engine.has_unfinished():
                    answering, step_started = bool(out), time.perf_counter()
                    finished = self.engine.step(self.eos)
                    seconds = time.perf_counter() - step_started
                    timing.engine_s += seconds
                    timing.engine_while_waiting_s += seconds if answering else 0.0
                    for request_id, completion in finished:
                        index = requests.pop(request_id)
                        episode = episodes[index]
                        turn, stopped = budget.took(
                            index, completion, cut=episode.cut or EMPTY_TURN, turn_limit=turn_limit(index)
                        )
                        if stopped:  # the round's budget stopped the turn, not its end or the episode's length
                            episode.cut = turn
                            rollout.waiting.append(index)
                            continue
                        episode.cut = None
                        pending = self._after_turn(episode, turn, finished_with_eos=completion.finished_with_eos)
                        if pending is not None:
                            out[asyncio.run_coroutine_threadsafe(pending, self._loop)] = index
                        else:
                            self._end(episode)
                    ready = [future for future in out if future.done()]
                elif not requests:  # nothing to generate until a tool or an environment answers
                    blocked_started = time.perf_counter()
                    awaited = [future for future, index in out.items() if can_go(future, index)]
                    concurrent.futures.wait(awaited, return_when=concurrent.futures.FIRST_COMPLETED)
                    ready = [future for future in out if future.done()]
                    timing.blocked_s += time.perf_counter() - blocked_started
                else:  # the engine dropped a request without finishing it: fail, rather than wait forever
                    raise RuntimeError(f"the rollout engine finished without answering {len(requests)} turn request(s)")
                again = []
                for future in ready:
                    index = out.pop(future)
                    if self._after_answers(episodes[index], future.result()):
                        again.append(index)
                    else:
                        self._end(episodes[index])
                submit(again)
        except BaseException:  # an error included: no answer is left running, no session left open
            self.abandon(rollout)
            raise
        finally:
            if rollout.done:
                for episode in episodes:
                    self._end(episode)
            closing, self._closing = self._closing, []
            concurrent.futures.wait(closing)
            timing.wall_s = time.perf_counter() - started

    def abandon(self, rollout: Rollout) -> None:
        """Stop what is out for `rollout`'s episodes and close their sessions (an error, or a rollout that
        will not be resumed)."""
        for future in rollout.out:
            future.cancel()
        concurrent.futures.wait(rollout.out)
        rollout.out.clear()
        rollout.waiting.clear()
        for episode in rollout.episodes:
            self._end(episode)
        closing, self._closing = self._closing, []
        concurrent.futures.wait(closing)

    def _end(self, episode: Episode) -> None:
        """The episode has ended: close its session now, so that its place goes to a waiting episode."""
        episode.finished = True
        if episode.session is not None:
            session, episode.session = episode.session, None
            self._closing.append(asyncio.run_coroutine_threadsafe(self._close(session), self._loop))

    def _after_turn(self, episode: Episode, turn: CutTurn, *, finished_with_eos: bool):
        """Record a finished turn; the coroutine answering it, or None when the episode ends."""
        episode.add(turn.token_ids, model=True, versions=turn.versions, logprobs=turn.logprobs)
        episode.turns += 1
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=False)
        episode.final_text = text.removesuffix(self.renderer.eos_text)
        if episode.ended:  # its session ended at the reset (failed, or done): this turn was its whole episode
            return None
        if not finished_with_eos or len(episode.response) >= self.max_response_length:
            episode.ended = "length"
            return None
        parsed = self.parser.parse(episode.final_text)
        if not parsed.wants_tools and self.environment is None:
            episode.ended = "answer"
            return None
        if episode.turns >= self.spec.max_turns:
            episode.ended = "max_turns"
            return None
        if parsed.wants_tools:
            return self._call_tools(parsed)
        assert episode.session is not None
        answer = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        return self._step(episode.session, answer)

    def _after_answers(self, episode: Episode, answers: Answers) -> bool:
        """Add the answers to the trajectory; whether the episode goes on (another turn to submit)."""
        for name, error, seconds, counts in answers.calls:
            episode.tool_calls[name] += 1
            episode.tool_errors[name] += int(error)
            episode.tool_seconds[name] = episode.tool_seconds.get(name, 0.0) + seconds
            episode.tool_counts.update(counts)
        if answers.kind != "tools":
            episode.step_seconds.append(answers.seconds)
        if answers.kind == "step":  # it answered the episode's latest turn
            episode.rewards.append(answers.reward or 0.0)
            episode.turn_rewards[-1] = answers.reward or 0.0
        if answers.kind == "reset":
            # The first turn always runs, a failed reset's too: a sample has at least one model turn to
            # train on (its reward says it found no environment).
            episode.ended = answers.ended
            episode.add(self.renderer.opening(answers.messages), model=False)
            return True
        if answers.ended:
            episode.ended = answers.ended
            return False
        if self._past_deadline(episode):
            episode.ended = EPISODE_TIMEOUT
            return False
        ids = self.renderer.between_turns(answers.messages)
        if len(episode.response) + len(ids) >= self.max_response_length:  # no token left to answer
            episode.ended = "observation_too_long" if answers.kind == "step" else "length"
            return False
        episode.add(ids, model=False)
        return True

    def _past_deadline(self, episode: Episode) -> bool:
        """Whether the episode has run agent.episode_timeout_s since it started (a weight update between
        rounds included): it then takes no further turn."""
        return time.perf_counter() - episode.started >= self.spec.episode_timeout_s

    # --- tools and environment (on the tools' event loop) --------------------------------------

    async def _call_tools(self, parsed: ParsedTurn) -> Answers:
        results = await asyncio.gather(*(self._call_one(call.name, call.arguments) for call in parsed.calls))
        malformed = [ToolResult(f"error: {message}", error=True) for message in parsed.malformed]
        calls = [(name, result.error, seconds, result.counts) for name, result, seconds in results]
        calls += [(MALFORMED, True, 0.0, {})] * len(malformed)
        texts = [result for _, result, _ in results] + malformed
        return Answers([{"role": "tool", "content": self._cut(result.text)} for result in texts], calls)

    async def _call_one(self, name: str, arguments: Mapping) -> tuple[str, ToolResult, float]:
        tool = self.tools.get(name)
        if tool is None:
            return (
                UNKNOWN,
                ToolResult(f"error: there is no tool {name!r}; the tools are {sorted(self.tools)}", True),
                0.0,
            )
        async with self._slots:
            start = time.perf_counter()
            try:
                result = await asyncio.wait_for(tool.call(arguments), timeout=self.spec.tool_timeout_s)
            except TimeoutError:
                result = ToolResult(
                    f"error: {name} took longer than {self.spec.tool_timeout_s:g} s and was stopped", True
                )
            except EnvironmentUnavailable as error:
                if error.fatal:  # the python sandbox's servers: none answered for its unavailable_timeout_s
                    raise
                result = ToolResult(f"error: {name} failed: {error}", True)
            except Exception as error:  # broad on purpose: a tool's bug is the model's error message, not a crash
                result = ToolResult(f"error: {name} failed: {type(error).__name__}: {error}", True)
            return name, result, time.perf_counter() - start

    async def _open(self, environment: Environment, episode: Episode, seed: int) -> Answers:
        """Open the episode's session and reset it: the opening messages, or why it ended."""
        assert episode.context is not None, "an environment's rollout passes each sample's row"
        if self._admitted is not None:
            await self._admitted.acquire()  # released when the session closes
        episode.started = time.perf_counter()  # agent.episode_timeout_s runs from the reset, not the wait
        session = environment.session()
        episode.session = session
        self.sessions_open += 1
        self.sessions_open_max = max(self.sessions_open_max, self.sessions_open)
        reset = session.reset(seed=seed, episode_id=f"{seed}-{episode.key}", context=episode.context)
        return await self._answer(environment, reset, kind="reset")

    async def _step(self, session: EnvironmentSession, text: str) -> Answers:
        assert self.environment is not None
        return await self._answer(self.environment, session.step(text), kind="step")

    async def _close(self, session: EnvironmentSession) -> None:
        try:
            await asyncio.wait_for(session.close(), timeout=self.spec.tool_timeout_s)
        except Exception as error:  # broad on purpose: the episode is complete; a session that cannot close
            # is the server's to reap (OpenEnv servers end a session when its connection goes)
            logger.warning("an environment session failed to close: %s: %s", type(error).__name__, error)
        finally:
            self.sessions_open -= 1
            if self._admitted is not None:
                self._admitted.release()

    async def _answer(self, environment: Environment, pending, *, kind: str) -> Answers:
        """The environment's observation as the answer to a turn (or a reset); a session that fails,
        times out or finds no replica ends the episode, counted by reason."""
        name = type(environment).__name__
        start = time.perf_counter()
        try:
            observation = await asyncio.wait_for(pending, timeout=self.spec.tool_timeout_s)
        except TimeoutError:  # e.g. a checker stuck on a pathological answer: the episode ends, the job goes on
            return Answers([], ended="environment_timeout", kind=kind, seconds=time.perf_counter() - start)
        except EnvironmentUnavailable as error:
            if error.fatal:  # no replica answered for servers.unavailable_timeout_s: the job cannot go on
                raise
            return Answers([], ended="environment_unavailable", kind=kind, seconds=time.perf_counter() - start)
        except EnvironmentProtocolError as error:  # before SessionFailed, its base
            logger.warning("agent.environment %s: an episode's server broke the protocol: %s", name, error)
            return Answers([], ended="environment_protocol_error", kind=kind, seconds=time.perf_counter() - start)
        except SessionFailed as error:
            logger.warning("agent.environment %s: an episode's session failed: %s", name, error)
            return Answers([], ended="environment_error", kind=kind, seconds=time.perf_counter() - start)
        except Exception as error:  # broad on purpose: user code in this process; its bug (or a bad ground
            # truth) stops the job with the field to look at, as a reward term's does
            raise RuntimeError(f"agent.environment {name} failed: {type(error).__name__}: {error}") from error
        seconds = time.perf_counter() - start
        if not isinstance(observation, Observation):
            raise TypeError(f"agent.environment {name} returned {observation!r}, not an Observation")
        if observation.reward is not None and not (
            math.isfinite(observation.reward) and abs(observation.reward) <= REWARD_LIMIT
        ):  # the dock keeps float32 rewards, which a NaN or an overflow would poison for the whole group
            logger.warning(
                "agent.environment %s: a reward that is not finite within %g: %r",
                name,
                REWARD_LIMIT,
                observation.reward,
            )
            return Answers([], ended="environment_protocol_error", kind=kind, seconds=seconds)
        messages = [{"role": "user", "content": self._cut(observation.message)}] if observation.message else []
        ended = "answer" if observation.done else ""
        return Answers(messages, ended=ended, kind=kind, reward=observation.reward, seconds=seconds)

    def _cut(self, text: str) -> str:
        """`text` within agent.max_tool_response_tokens, saying how much was cut. The text is first cut to
        CHARS_PER_TOKEN characters a token, so an observation of megabytes is never tokenized whole; the
        special tokens' text in it stays plain text (conversation.plain_ids)."""
        limit = self.spec.max_tool_response_tokens
        head = text[: limit * CHARS_PER_TOKEN]
        ids = plain_ids(self.tokenizer, head)
        if len(ids) <= limit and len(head) == len(text):
            return text
        if len(ids) <= limit:
            return head + f"\n[{len(text) - len(head)} more characters cut]"
        kept = self.tokenizer.decode(ids[:limit])
        if len(head) == len(text):
            return kept + f"\n[{len(ids) - limit} more tokens cut]"
        return kept + f"\n[{len(text) - len(kept)} more characters cut]"


# Characters kept per token of agent.max_tool_response_tokens before a tool's or an environment's text is
# tokenized: above what tokenizers put in one token of ordinary text, far below a hostile megabyte.
CHARS_PER_TOKEN = 32
