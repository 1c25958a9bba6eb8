"""The multi-turn rollout: episodes in which the policy generates, calls tools, reads their results
and goes on, each ending as one sample of the transfer dock.

One episode per sample. A turn is one engine request (the prompt plus the trajectory so far); it
ends at the model's EOS. A turn with tool calls (agent.tool_call_format) gets the tools' results as
`tool` messages and the next turn; a turn without one is the final answer, which the environment
(if any) may answer with a `user` message and another turn. An episode ends at a final answer the
environment accepts (or any final answer without one), after agent.max_turns turns, or when
algorithm.max_response_length, which counts every token after the prompt, is used up: a message
that would leave the model no token to answer is not added.

The engine is never idle on a tool: turns of all episodes share one engine, the tools run as
coroutines on an event loop in a thread of their own, and the loop steps the engine for the other
episodes while calls are out; it blocks on the tools only when no request is left to generate.

Each episode's seed is mixed from (engine seed, iteration, sample key, turn): a resumed iteration,
or the same sample on another rank, samples the same turns given the same tool results.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rldock.config.job import AgentSpec
from rldock.runtime.agent.base import (
    Environment,
    EnvironmentReply,
    EpisodeContext,
    ParsedTurn,
    Tool,
    ToolCallParser,
    ToolResult,
)
from rldock.runtime.agent.conversation import ChatRenderer
from rldock.runtime.engines.vllm_rollout import Completion, VllmRolloutEngine


@dataclass
class Episode:
    """One sample's trajectory: every token after the prompt, and which of them the model sampled."""

    prompt: list[int]
    key: int  # the sample's stable id, for its turns' seeds
    context: EpisodeContext | None  # what the environment checks the answer against
    response: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)  # 1: sampled by the model (trained on)
    turns: int = 0
    final_text: str = ""  # the model's last turn, decoded
    tool_calls: Counter[str] = field(default_factory=Counter)  # per tool name
    tool_errors: Counter[str] = field(default_factory=Counter)  # per tool name ("malformed", "unknown")
    tool_seconds: dict[str, float] = field(default_factory=dict)  # per tool name
    tool_counts: Counter[str] = field(default_factory=Counter)  # the tools' own counts (ToolResult.counts)
    ended: str = ""  # answer | max_turns | length | environment_timeout

    def add(self, ids: Sequence[int], *, model: bool) -> None:
        self.response.extend(ids)
        self.model_mask.extend([int(model)] * len(ids))

    @property
    def num_tool_calls(self) -> int:
        return sum(self.tool_calls.values())

    @property
    def num_tool_errors(self) -> int:
        return sum(self.tool_errors.values())


# What a turn's tools or the environment answered: the messages, and each call's (tool, error, seconds,
# the tool's own counts).
@dataclass(frozen=True)
class Answers:
    messages: list[dict]
    calls: list[tuple[str, bool, float, Mapping[str, int]]] = field(default_factory=list)
    ended: str = ""  # why the environment ended the episode: "answer" (accepted), "environment_timeout"


MALFORMED, UNKNOWN = "malformed", "unknown"  # tool-error keys of calls that named no tool


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

    async def _make_slots(self) -> asyncio.Semaphore:
        return asyncio.Semaphore(self.spec.max_concurrent_tool_calls)  # bound to the tools' loop

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
        episodes = [Episode(list(p), key, context) for p, key, context in zip(prompts, keys, contexts)]
        requests: dict[str, int] = {}  # engine request id -> episode

        def submit(indices: list[int]) -> None:
            ids = self.engine.submit(
                [episodes[i].prompt + episodes[i].response for i in indices],
                max_tokens=[self.max_response_length - len(episodes[i].response) for i in indices],
                eos_token_id=self.eos,
                seed=seed,
                request_keys=[(episodes[i].key, episodes[i].turns) for i in indices],
                greedy=greedy,
            )
            requests.update(zip(ids, indices))

        out: dict[concurrent.futures.Future, int] = {}  # tool or environment answers -> episode
        submit(list(range(len(episodes))))
        while requests or out:
            if self.engine.has_unfinished():
                for request_id, completion in self.engine.step(self.eos):
                    index = requests.pop(request_id)
                    pending = self._after_turn(episodes[index], completion)
                    if pending is not None:
                        out[asyncio.run_coroutine_threadsafe(pending, self._loop)] = index
                ready = [future for future in out if future.done()]
            elif out:  # nothing to generate until a tool answers
                ready = list(concurrent.futures.wait(out, return_when=concurrent.futures.FIRST_COMPLETED).done)
            else:  # the engine dropped a request without finishing it: fail, rather than wait forever
                raise RuntimeError(f"the rollout engine finished without answering {len(requests)} turn request(s)")
            again = [out[future] for future in ready if self._after_answers(episodes[out[future]], future.result())]
            for future in ready:
                del out[future]
            submit(again)
        return episodes

    def _after_turn(self, episode: Episode, completion: Completion):
        """Record a finished turn; the coroutine answering it, or None when the episode ends."""
        episode.add(completion.token_ids, model=True)
        episode.turns += 1
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
        episode.final_text = text.removesuffix(self.renderer.eos_text)
        if not completion.finished_with_eos or len(episode.response) >= self.max_response_length:
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
        assert self.environment is not None
        return self._ask_environment(self.environment, episode)

    def _after_answers(self, episode: Episode, answers: Answers) -> bool:
        """Add the answers to the trajectory; whether the episode goes on (another turn to submit)."""
        for name, error, seconds, counts in answers.calls:
            episode.tool_calls[name] += 1
            episode.tool_errors[name] += int(error)
            episode.tool_seconds[name] = episode.tool_seconds.get(name, 0.0) + seconds
            episode.tool_counts.update(counts)
        if answers.ended:
            episode.ended = answers.ended
            return False
        ids = self.renderer.between_turns(answers.messages)
        if len(episode.response) + len(ids) >= self.max_response_length:  # no token left to answer
            episode.ended = "length"
            return False
        episode.add(ids, model=False)
        return True

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
            except Exception as error:  # broad on purpose: a tool's bug is the model's error message, not a crash
                result = ToolResult(f"error: {name} failed: {type(error).__name__}: {error}", True)
            return name, result, time.perf_counter() - start

    async def _ask_environment(self, environment: Environment, episode: Episode) -> Answers:
        assert episode.context is not None, "an environment's rollout passes each sample's row"
        name = type(environment).__name__
        try:
            reply = await asyncio.wait_for(
                environment.respond(episode.final_text, turn=episode.turns, context=episode.context),
                timeout=self.spec.tool_timeout_s,
            )
        except TimeoutError:  # e.g. a checker stuck on a pathological answer: the episode ends, the job goes on
            return Answers([], ended="environment_timeout")
        except Exception as error:  # broad on purpose: user code; an environment's bug (or a bad ground
            # truth) stops the job with the field to look at, as a reward term's does
            raise RuntimeError(f"agent.environment {name} failed: {type(error).__name__}: {error}") from error
        if not isinstance(reply, EnvironmentReply):
            raise TypeError(f"agent.environment {name}.respond returned {reply!r}, not an EnvironmentReply")
        if reply.done or reply.message is None:
            return Answers([], ended="answer")
        return Answers([{"role": "user", "content": self._cut(reply.message)}])

    def _cut(self, text: str) -> str:
        """`text` within agent.max_tool_response_tokens, saying how much was cut."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = self.spec.max_tool_response_tokens
        if len(ids) <= limit:
            return text
        return self.tokenizer.decode(ids[:limit]) + f"\n[{len(ids) - limit} more tokens cut]"
