"""A rank's harness episodes on its engine: the gateway served for them, the harness run once per episode,
the engine pumped in the caller's thread until every episode has ended, and each episode's samples for the
dock (a row per segment) with the measures of their exactness.

Built once per actor rank (rollout/harness.py); `run` is called per batch of the rollout. In rounds
(rollout.partial_rollout resume): `start` the batch's harnesses, `advance` once per round on the weights
of that round (gateway/server.py, "Rounds"), with a weight update between rounds, and `results` once
every episode has ended. Between rounds the harnesses keep running and their sessions stay open.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from jinja2 import TemplateError

from rldock.config import JobConfig
from rldock.contract.agent_pods import GATEWAY_PORT
from rldock.contract.runtime_cli import ENVIRONMENT_TOKEN_ENV
from rldock.runtime.agent.builders import build_parser
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.chat.cut_turns import RoundBudget, logprobs_of
from rldock.runtime.chat.parsers import REASONING_PARSERS
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.gateway.answers import Shaper
from rldock.runtime.gateway.dispatch import EpisodeDispatcher
from rldock.runtime.gateway.harness_runner import HarnessError, HarnessOutcome, HarnessRunner, check_not_all_broken
from rldock.runtime.gateway.server import EngineTurns, Gateway, GatewayLoop
from rldock.runtime.gateway.sessions import Segment, SegmentRow, Session, rerendered_drift

log = logging.getLogger(__name__)

MODEL_NAME = "policy"  # the `model` the answers name (a harness names any, unless agent.served_models lists them)
RENDERERS_KEPT = 8  # renderers cached, one per distinct `tools` list (a miss costs two renders of a probe)
KEPT_TOOLS_CHARS = 256 << 10  # a longer `tools` list (its JSON) gets a renderer per request, never cached
ENGINE_REFUSED = "engine_refused"  # how an episode ends when the engine refused one of its turns


class EpisodeSource(Protocol):
    """Who runs an episode's harness to its outcome: HarnessRunner (in the actor) or EpisodeDispatcher (pods)."""

    async def __call__(self, task: dict, *, name: str, base_url: str, api_key: str) -> HarnessOutcome: ...


def pod_token() -> str:
    """The job's pod token the agent pods lease with (the operator sets it in the Ray pods)."""
    token = os.environ.get(ENVIRONMENT_TOKEN_ENV, "")
    if not token:
        raise HarnessError(
            f"agent.harness_pods: {ENVIRONMENT_TOKEN_ENV} is not set, so no pod could lease an episode; in an RLJob "
            "the operator sets it with spec.agents (outside one, set it to the token your runners send)"
        )
    return token


@dataclass
class EpisodeResult:
    """One episode: the samples it becomes (a row per segment), how it ended, its rewards and measures."""

    row: SegmentRow  # its last segment's, whose final turn the reward judges
    ended: str
    rewards: list[float]  # posted to `.../reward`, then returned
    turns: int  # model turns over all segments
    tool_calls: int
    segments: list[str] = field(default_factory=list)  # each segment's reason
    exact: bool = True  # the row's model tokens are the engine's sampled ones for its turns
    drift_tokens: int | None = None  # re-rendering the final messages: held ids off (None: not measured)
    resends: int = 0
    final_turn: list[int] = field(default_factory=list)  # the ids of the episode's last model turn
    rows: list[SegmentRow] = field(default_factory=list)  # every segment's, in order (`row` the last)
    # per reward, the (segment, turn) of `rows` it follows: a posted one's turn (Session.latest_turn), None for
    # one posted before any turn and for the returned ones (algorithm.credit: turn puts those on the last turn)
    reward_turns: list[tuple[int, int] | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.reward_turns) == len(self.rewards), "a place for every reward, None where it has none"


@dataclass
class HarnessBatch:
    """A batch of episodes whose harnesses run on the gateway (`GatewayEpisodes.start`), across rounds."""

    names: list[str]
    keys: list[int]  # the sample keys: the episodes' turns' seeds
    prompts: list[list[int]]
    seed: int
    greedy: bool
    outcomes: concurrent.futures.Future  # the harnesses' outcomes, once every one has ended
    rounds: list[RoundBudget] = field(default_factory=list)  # each round run, with its tokens per episode
    unfinished: set[int] = field(default_factory=set)  # keys of the episodes the first round left running
    done: bool = False
    engine_s: float = 0.0  # seconds in engine steps, every round
    wall_s: float = 0.0  # seconds in this object's calls, every round (not the weight update between)


class RendererCache:
    """The chat template's renderer for each distinct `tools` list a request sends: the `size` used last, each
    of a list of at most KEPT_TOOLS_CHARS (a harness that sends a new list each request costs a renderer each,
    not memory without end; a renderer holds its tools). Called from the gateway's render threads."""

    def __init__(self, tokenizer, *, size: int = RENDERERS_KEPT):
        self.tokenizer, self.size = tokenizer, size
        self._renderers: collections.OrderedDict[str, ChatRenderer] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._renderers)

    def __call__(self, tools: Sequence[dict]) -> ChatRenderer:
        key = json.dumps(list(tools), sort_keys=True)
        with self._lock:
            renderer = self._renderers.get(key)
            if renderer is not None:
                self._renderers.move_to_end(key)
                return renderer
        renderer = ChatRenderer(self.tokenizer, tools=list(tools))  # the template's probes, outside the lock
        if len(key) > KEPT_TOOLS_CHARS:
            return renderer
        with self._lock:
            self._renderers[key] = renderer
            self._renderers.move_to_end(key)
            while len(self._renderers) > self.size:
                self._renderers.popitem(last=False)
        return renderer


class GatewayEpisodes:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        tokenizer,
        prompt_capacity: int,
        max_waiting: int = 1024,
        pod_port: int = GATEWAY_PORT,
        keep_logprobs: bool | None = None,
    ):
        """`pod_port`: where agent pods reach the gateway (agent.harness_pods; a test's 0 lets the kernel pick).
        `keep_logprobs`: whether every sampled token's logprob is kept, whatever a request asks (the job
        recipe's rollout state writes them: partial rollout, the mismatch's measure); None: under partial
        rollout."""
        assert cfg.agent is not None, "harness episodes are for jobs with an agent section"
        self.cfg, self.tokenizer = cfg, tokenizer
        # Who runs each episode's harness: the actor itself, or the agent pods through the dispatcher.
        self.runner: EpisodeSource = (
            EpisodeDispatcher(token=pod_token(), timeout_s=cfg.agent.episode_timeout_s)
            if cfg.agent.harness_pods
            else HarnessRunner(cfg.agent)
        )
        self.renderers = RendererCache(tokenizer)
        shaper = Shaper(
            tokenizer,
            model=MODEL_NAME,
            served=cfg.agent.served_models,
            tool_parser=build_parser(cfg.agent),
            reasoning_parser=REASONING_PARSERS.get(cfg.agent.reasoning_format)(),
        )
        self.turns = EngineTurns()
        self.keep_logprobs = cfg.rollout.partial_rollout != "off" if keep_logprobs is None else keep_logprobs
        self.prompt_capacity = prompt_capacity
        self.gateway = Gateway(
            shaper=shaper,
            renderer=self.renderers,
            turns=self.turns,
            prompt_capacity=prompt_capacity,
            response_capacity=cfg.algorithm.max_response_length,
            max_waiting=max_waiting,
            keep_logprobs=self.keep_logprobs,
        )
        if isinstance(self.runner, EpisodeDispatcher):
            self.gateway.mounts.append(self.runner.mount)
            try:
                self.server = GatewayLoop(self.gateway, host="0.0.0.0", port=pod_port)  # noqa: S104 - pods reach it
            except OSError as error:
                raise HarnessError(
                    f"agent.harness_pods: the gateway cannot serve the agent pods on port {pod_port} ({error}); one "
                    "generating actor rank per Ray pod serves them (fewer ranks per node, or more nodes)"
                ) from error
        else:
            self.server = GatewayLoop(self.gateway)
        self.engine_s = 0.0  # the last run's seconds in engine steps
        self.wall_s = 0.0

    def run(
        self,
        engine: VllmRolloutEngine,
        *,
        tasks: Sequence[dict],
        prompts: Sequence[list[int]],
        keys: Sequence[int],
        seed: int,
        greedy: bool = False,
    ) -> list[EpisodeResult]:
        """One harness episode per task (its dock prompt `prompts[i]` and sample key `keys[i]`), in one round."""
        batch = self.start(tasks=tasks, prompts=prompts, keys=keys, seed=seed, greedy=greedy)
        self.advance(engine, batch)
        return self.results(engine, batch)

    def start(
        self,
        *,
        tasks: Sequence[dict],
        prompts: Sequence[list[int]],
        keys: Sequence[int],
        seed: int,
        greedy: bool = False,
    ) -> HarnessBatch:
        """Start one harness per task; `advance` serves their turns."""
        assert not set(keys) & self.turns.running(), "a batch's sample keys are not another open batch's"
        started = time.perf_counter()
        names = [f"{seed}-{key}" for key in keys]
        self.turns.open(keys)  # before any harness runs: a round waits for every one of them

        async def one(name: str, key: int, task: dict) -> HarnessOutcome:
            try:
                episode = self.gateway.open(name, key=key)
                return await self.runner(task, name=name, base_url=self.server.base_url(name), api_key=episode.token)
            finally:
                self.turns.end(key)

        async def every() -> list[HarnessOutcome]:
            return list(await asyncio.gather(*(one(n, k, t) for n, k, t in zip(names, keys, tasks))))

        outcomes = self.server.run(every())
        batch = HarnessBatch(names, list(keys), [list(p) for p in prompts], seed, greedy, outcomes)
        batch.wall_s += time.perf_counter() - started
        return batch

    def advance(
        self,
        engine: VllmRolloutEngine,
        batch: HarnessBatch,
        *,
        policy_version: int = 0,
        round_tokens: int | None = None,
    ) -> bool:
        """Serve the batch's turns on the engine's weights (`policy_version`) until every episode has ended, or,
        with `round_tokens`, until every one still running has sampled that many tokens in this round (its
        turn then cut, resumed by the next call); whether every episode has ended."""
        started = time.perf_counter()
        budget = RoundBudget(round_tokens, policy_version)
        try:
            batch.done, engine_s = self.turns.pump(
                engine,
                keys=batch.keys,
                eos_token_id=self.tokenizer.eos_token_id,
                seed=batch.seed,
                greedy=batch.greedy,
                budget=budget,
            )
        except BaseException:  # the engine failed: no harness is left waiting on it
            batch.outcomes.cancel()
            raise
        if not batch.rounds and not batch.done:
            batch.unfinished = self.turns.running() & set(batch.keys)
        batch.rounds.append(budget)
        batch.engine_s += engine_s
        batch.wall_s += time.perf_counter() - started
        return batch.done

    def results(self, engine: VllmRolloutEngine, batch: HarnessBatch) -> list[EpisodeResult]:
        """The ended batch's episodes (`advance` returned True)."""
        assert batch.done, "a batch's results are read once every episode has ended"
        started = time.perf_counter()
        names, prompts, keys, seed, greedy = batch.names, batch.prompts, batch.keys, batch.seed, batch.greedy
        version = batch.rounds[-1].policy_version

        async def settled() -> None:  # turns answered after their harness ended are committed first
            for name in names:
                async with self.gateway.episodes[name].lock:
                    pass

        outcomes = batch.outcomes.result()
        self.server.run(settled()).result()
        episodes = [self.gateway.close(name) for name in names]
        # an episode whose turn the engine refused is not the harness's failure
        check_not_all_broken([o for o, e in zip(outcomes, episodes) if not e.refused])
        silent = [i for i, episode in enumerate(episodes) if not episode.session.segments]
        # An episode whose harness never reached the model still gets one turn on its prompt: every sample
        # has tokens of the model's (its reward says it failed).
        fallback = engine.sample(
            [prompts[i] for i in silent],
            n=1,
            max_tokens=self.cfg.algorithm.max_response_length,
            eos_token_id=self.tokenizer.eos_token_id,
            seed=seed,
            greedy=greedy,
            logprobs=self.keep_logprobs,
            prompt_keys=[keys[i] for i in silent],
        )
        fallback_turns = {i: group[0] for i, group in zip(silent, fallback)}
        results = []
        for index, (episode, outcome) in enumerate(zip(episodes, outcomes)):
            if index in fallback_turns:
                completion = fallback_turns[index]
                turn = list(completion.token_ids)
                ended = outcome.ended if outcome.ended != "harness_done" else "harness_no_turn"
                row = SegmentRow(
                    [*prompts[index], *turn],
                    len(prompts[index]),
                    [1] * len(turn),
                    ended,
                    [version] * len(turn),
                    logprobs_of(completion),
                    [0] * len(turn),
                )
                results.append(
                    EpisodeResult(
                        row,
                        ended,
                        list(episode.rewards),
                        1,
                        0,
                        [ended],
                        final_turn=turn,
                        rows=[row],
                        reward_turns=[None] * len(episode.rewards),  # posted before the turn it has now
                    )
                )
                continue
            results.append(self._result(episode.session, episode, outcome))
        for episode, result in zip(episodes, results):
            if episode.refused:  # whatever its harness made of the refusal, the engine ended the episode
                result.ended = ENGINE_REFUSED
        batch.wall_s += time.perf_counter() - started
        self.engine_s, self.wall_s = batch.engine_s, batch.wall_s
        return results

    def _result(self, session: Session, episode, outcome: HarnessOutcome) -> EpisodeResult:
        rows = session.rows(prompt_capacity=self.prompt_capacity)
        last = session.segments[-1]
        turns = sum(segment.turns for segment in session.segments)
        engine_turns = self.turns.sampled.get(episode.key, [])[-turns:]
        # every segment's model tokens, in order, are the engine's turns of the episode
        model_ids = [
            token for row in rows for token, model in zip(row.ids[row.prompt_length :], row.model_mask) if model
        ]
        exact = model_ids == [token for turn in engine_turns for token in turn]
        tools = [json.loads(tool) for tool in last.tools]
        return EpisodeResult(
            row=rows[-1],
            ended=outcome.ended,
            rewards=[*episode.rewards, *outcome.rewards],
            turns=turns,
            tool_calls=episode.tool_calls,
            segments=[segment.reason for segment in session.segments],
            exact=exact,
            drift_tokens=self._drift(last, tools),
            resends=episode.resends,
            final_turn=list(last.sampled[-1]),
            rows=rows,
            reward_turns=[*episode.reward_turns, *[None] * len(outcome.rewards)],
        )

    def _drift(self, segment: Segment, tools: list[dict]) -> int | None:
        """The debug report's drift of re-rendering `segment`'s messages; None where it is not measured: a
        segment from token ids (its history is the last answer only, not a conversation) or one the chat
        template refuses to render (a report, never a reason to fail the rollout)."""
        if not segment.history or segment.from_ids:
            return None
        try:
            return rerendered_drift(segment, self.renderers(tools)).tokens
        except (TemplateError, ValueError) as error:
            log.warning("the re-rendering drift is not measured: the chat template refused the messages: %s", error)
            return None

    def close(self) -> None:
        self.server.close()
        self.gateway.shutdown()
