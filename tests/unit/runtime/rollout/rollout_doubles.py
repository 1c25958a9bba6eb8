"""Test doubles for the rollout mode tests (imported by basename): an engine that answers with fixed
responses and records what it was asked, a one-batch dock that records what is written, and for carried
episodes a one-token engine and an environment whose episodes wait for their group's gate."""

from __future__ import annotations

import asyncio
import string
from dataclasses import dataclass

import torch
from dock_double_base import PutThenGet  # tests/dock_double_base.py
from tensordict import TensorDict

from rldock.config.agent import AgentSpec
from rldock.runtime.agent.episode_loop import AgentLoop
from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, Observation
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.chat.parsers import HermesParser
from rldock.runtime.data import Row
from rldock.runtime.data.row_column import row_bytes
from rldock.runtime.engines.vllm_rollout import Completion
from rldock.runtime.models.tiny import CHAT_TEMPLATE, train_char_tokenizer

EOS, PAD = 2, 0


def completion(tokens: list[int], logprob: float) -> Completion:
    return Completion(tokens, [logprob] * len(tokens), finished_with_eos=bool(tokens) and tokens[-1] == EOS)


@dataclass(frozen=True)
class Call:
    prompts: list[list[int]]
    n: int
    max_tokens: int
    seed: int | None
    prompt_keys: list[int] | None
    greedy: bool = False


class EngineDouble:
    """Test double of VllmRolloutEngine (no vLLM in a unit test): response j of a prompt is j+1
    tokens of 7 then EOS, truncated at max_tokens; every logprob is -(version + 1), so a token's
    logprob says which weights sampled it. `stream` yields the prompts last first, as an engine
    that finished the later ones first would."""

    def __init__(self):
        self.version, self.calls = 0, []

    def sample(self, prompts, *, n, max_tokens, eos_token_id, seed, greedy=False, logprobs=False, prompt_keys=None):
        self.calls.append(Call(prompts, n, max_tokens, seed, prompt_keys, greedy))
        return [
            [completion(([7] * (j + 1) + [eos_token_id])[:max_tokens], -(self.version + 1.0)) for j in range(n)]
            for _ in prompts
        ]

    def generate(self, prompts, *, n, max_tokens, eos_token_id, seed, prompt_keys=None):
        completions = self.sample(
            prompts, n=n, max_tokens=max_tokens, eos_token_id=eos_token_id, seed=seed, prompt_keys=prompt_keys
        )
        return [[c.token_ids for c in group] for group in completions]

    def stream(self, prompts, *, n, max_tokens, eos_token_id, seed, logprobs=False, prompt_keys=None):
        per_prompt = self.sample(
            prompts,
            n=n,
            max_tokens=max_tokens,
            eos_token_id=eos_token_id,
            seed=seed,
            logprobs=logprobs,
            prompt_keys=prompt_keys,
        )
        yield from reversed(list(enumerate(per_prompt)))


class RecordingDock(PutThenGet):
    """Test double of TransferDock for one rank: hands out the whole batch once (indices from
    `first_index`), keeps every put with its policy version."""

    def __init__(self, batch: TensorDict, first_index: int = 0):
        self.batch, self.first_index, self.given = batch, first_index, False
        self.waited_s, self.drained = 0.0, False
        self.gets: list[tuple[str, list[str], int]] = []  # (state, columns, batch_size)
        self.puts: list[tuple[list[int], TensorDict, int | None]] = []

    def get(self, state, columns, *, batch_size, **kwargs):
        self.gets.append((state, list(columns), batch_size))
        if self.given:
            return None
        self.given = True
        return torch.arange(len(self.batch)) + self.first_index, self.batch.select(*columns)

    def put(self, indices, out, *, policy_version=None):
        self.puts.append((indices.tolist(), out, policy_version))

    def written(self) -> TensorDict:
        """Every row put, in index order."""
        rows = [i for indices, _, _ in self.puts for i in indices]
        out = torch.cat([out for _, out, _ in self.puts])
        return out[torch.tensor(rows).argsort()]


# The train row every prompt of `prompts_of` comes from, as the dock carries it (`prompt_row`).
TRAIN_ROW = row_bytes(Row("2+2=", "42", "arithmetic"))


def prompts_of(*prompts: list[int], group: int) -> TensorDict:
    """The dock's prompt columns of whole groups: each prompt once per response, left-padded to 3, with its
    train row (TRAIN_ROW) by number and whole."""
    rows = [[PAD] * (3 - len(p)) + p for p in prompts for _ in range(group)]
    prompt_ids = torch.tensor(rows)  # (B, PL)
    return TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": (prompt_ids != PAD).long(),
            "prompt_index": torch.arange(len(rows)) // group,
            "prompt_row": torch.frombuffer(bytearray(TRAIN_ROW * len(rows)), dtype=torch.uint8).view(len(rows), -1),
        },
        batch_size=[len(rows)],
    )


class AnsweringEngine:
    """Test double of VllmRolloutEngine's multi-turn side (submit / step): every request is answered
    at once with `answer` then EOS, a final answer that ends the episode, within the request's
    max_tokens (a resumed turn, key (sample, turn, c), gets the rest from token c); records each
    request's (seed, key). With logprobs each token's is `-(weights + 1) / 100`, the version of the
    weights it holds (`weights`) visible."""

    seed = 0  # the engine's own seed (the job's)
    weights = 0

    def __init__(self, answer: list[int]):
        self.answer, self.queue, self.requests = answer, [], []

    def submit(self, prompts, *, max_tokens, eos_token_id, seed, request_keys, greedy=False, logprobs=False):
        ids = [str(len(self.requests) + i) for i in range(len(prompts))]
        self.requests += [(seed, tuple(key)) for key in request_keys]
        self.queue += [(i, limit, tuple(key), logprobs) for i, limit, key in zip(ids, max_tokens, request_keys)]
        return [*ids]

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self, eos_token_id):
        finished, self.queue = self.queue, []
        out = []
        for request_id, limit, (_, _, *sampled), logprobs in finished:
            tokens = [*self.answer, eos_token_id][sum(sampled) :][:limit]
            scores = [-(self.weights + 1) / 100] * len(tokens) if logprobs else None
            out.append((request_id, Completion(tokens, scores, tokens[-1:] == [eos_token_id])))
        return out


class OneTokenEngine:
    """Test double of VllmRolloutEngine: every turn is one token then EOS, each token's logprob
    -(weights + 1) so the weights that sampled it show."""

    seed = 0
    weights = 0

    def __init__(self):
        self.queue: list[tuple[str, bool]] = []
        self._ids = 0

    def submit(self, prompts, *, max_tokens, eos_token_id, seed, request_keys, greedy=False, logprobs=False):
        ids = []
        for _ in prompts:
            self._ids += 1
            ids.append(str(self._ids))
            self.queue.append((str(self._ids), logprobs))
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self, eos_token_id):
        request_id, logprobs = self.queue.pop(0)
        tokens = [5, eos_token_id]
        return [(request_id, Completion(tokens, [-(self.weights + 1.0)] * 2 if logprobs else None, True))]


class Gated(Environment):
    """Two steps per episode: the first waits for its group's gate (the context's ground truth names the
    group) and asks again, the second ends the episode. Records how many sessions closed."""

    def __init__(self):
        self.gates: dict[str, asyncio.Event] = {}
        self.closed = 0

    def gate(self, name: str) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    def session(self) -> EnvironmentSession:
        return GatedSession(self)


class GatedSession(EnvironmentSession):
    def __init__(self, environment: Gated):
        self.environment, self.steps = environment, 0

    async def reset(self, *, seed, episode_id, context):
        self.name = context.ground_truth
        return Observation()

    async def step(self, text):
        self.steps += 1
        if self.steps == 1:
            await self.environment.gate(self.name).wait()
            return Observation(message="again", reward=0.0)
        return Observation(done=True, reward=1.0)

    async def close(self):
        self.environment.closed += 1


def chat_char_tokenizer():
    """A character tokenizer with the tiny models' chat template."""
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def gated_loop(tokenizer, engine: OneTokenEngine, environment: Gated) -> AgentLoop:
    """The episode loop of the carried-episode tests: `engine`'s turns, `environment`'s steps, 3 turns at most."""
    return AgentLoop(
        engine=engine,
        tokenizer=tokenizer,
        renderer=ChatRenderer(tokenizer, tools=[], opens_with_environment=True),
        tools={},
        environment=environment,
        parser=HermesParser(),
        spec=AgentSpec(max_turns=3),
        max_response_length=64,
    )
