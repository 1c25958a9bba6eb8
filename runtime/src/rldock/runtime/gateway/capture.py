"""`rldock agent capture`'s episode: a job's harness run once, on one task, against the gateway with no model
behind it, and its first request kept (chat/harness_request.py) to render the job's prompts with.

The gateway is the job's own (GatewayEpisodes: its Chat Completions and Responses routes, its renderer, the
harness run as the job runs it); only the engine is a stand-in, `AnsweringEngine`, which answers every turn
with the task's ground truth (so a harness that stops at an answer stops after one turn; one that goes on is
stopped by agent.episode_timeout_s). What the harness sent is read from the episode's session: the first
segment's prompt ids (the first request rendered) and its messages, of which those before the task's prompt,
with the request's tools, are the capture. The capture is checked: the job's renderer with it
(job_conversation's) gives the task's prompt the same ids as the gateway gave the first request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rldock.config import JobConfig
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.chat.harness_request import HarnessRequest, HarnessRequestError, captured
from rldock.runtime.data.rendering import prompt_messages
from rldock.runtime.data.rows import RawPrompt
from rldock.runtime.engines.vllm_rollout import Completion
from rldock.runtime.gateway.episodes import GatewayEpisodes


class AnsweringEngine:
    """A stand-in for the rollout engine (the gateway's engine interface: submit, step, abort, sample) that
    answers every request with `answer` (token ids, EOS last), cut at the request's limit."""

    def __init__(self, answer: list[int]):
        self.answer = list(answer)
        self.queue: list[tuple[str, int]] = []  # (request id, max tokens)
        self._ids = 0

    def submit(self, prompts, *, max_tokens, eos_token_id, seed, request_keys, greedy=False, logprobs=False):
        ids = []
        for limit in max_tokens:
            self._ids += 1
            ids.append(str(self._ids))
            self.queue.append((str(self._ids), limit))
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def abort(self, request_ids) -> None:
        self.queue = [item for item in self.queue if item[0] not in request_ids]

    def step(self, eos_token_id):
        request_id, limit = self.queue.pop(0)
        return [(request_id, self._completion(limit, eos_token_id))]

    def sample(self, prompts, *, n, max_tokens, eos_token_id, seed, greedy=False, logprobs=False, prompt_keys=None):
        return [[self._completion(max_tokens, eos_token_id)] for _ in prompts]

    def _completion(self, limit: int, eos_token_id: int) -> Completion:
        tokens = self.answer[:limit]
        return Completion(tokens, None, bool(tokens) and tokens[-1] == eos_token_id)


class _FirstTools:
    """The gateway's renderer cache, keeping the `tools` of the first request it renders, as the request sent them."""

    def __init__(self, renderers: Callable[[Sequence[dict]], ChatRenderer]):
        self.renderers = renderers
        self.first: list[dict] | None = None

    def __call__(self, tools: Sequence[dict]) -> ChatRenderer:
        if self.first is None:
            self.first = [dict(tool) for tool in tools]
        return self.renderers(tools)


@dataclass(frozen=True)
class Capture:
    """A harness's first request kept, and the ids its prompt got from the gateway and from the job."""

    request: HarnessRequest
    gateway_ids: list[int]  # the first request's prompt ids, as the gateway rendered it
    job_ids: list[int]  # the task's prompt rendered as the job renders it with `request` (job_conversation)
    ended: str  # how the harness's episode ended (`harness_done` when it wrote its result)

    @property
    def summary(self) -> dict:
        return {
            "tools": [tool.get("function", {}).get("name") for tool in self.request.tools],
            "messages": len(self.request.messages),
            "prompt_tokens": len(self.gateway_ids),
            "prompt_ids_equal": self.gateway_ids == self.job_ids,
            "ended": self.ended,
        }


def capture_first_request(cfg: JobConfig, *, tokenizer, task: dict, prompt: RawPrompt) -> Capture:
    """Run `cfg`'s harness on `task` (whose row's prompt is `prompt`) and keep its first request; a
    HarnessRequestError when it sent none or its first request does not end with the row's prompt."""
    episodes = GatewayEpisodes(cfg, tokenizer=tokenizer, prompt_capacity=cfg.algorithm.max_prompt_length)
    try:
        answer = tokenizer(str(task["ground_truth"]), add_special_tokens=False)["input_ids"]
        engine = AnsweringEngine([*answer, tokenizer.eos_token_id])
        seen = _FirstTools(episodes.renderers)
        episodes.gateway.renderer = seen
        batch = episodes.start(tasks=[task], prompts=[[tokenizer.eos_token_id]], keys=[0], seed=cfg.seed)
        # the stand-in serves the gateway's engine interface, not the whole VllmRolloutEngine
        episodes.advance(engine, batch)  # type: ignore[arg-type]
        session = episodes.gateway.episodes[batch.names[0]].session
        (result,) = episodes.results(engine, batch)  # type: ignore[arg-type]
    finally:
        episodes.close()
    if not session.segments or session.segments[0].from_ids:
        how = "sent no request" if not session.segments else "sent token ids (/v1/completions), not messages"
        raise HarnessRequestError(
            f"the harness {how} (its episode ended {result.ended}), so there is no chat request to render the "
            "job's prompts as; run it as the job does and check its log"
        )
    first = session.segments[0]
    # the tools as sent: the segment keeps them canonical (keys sorted), which a template would render otherwise
    tools = seen.first or []
    assert [json.dumps(tool, sort_keys=True) for tool in tools] == list(first.tools), "the first request's tools"
    request = captured(first.history, tools, _row_messages(prompt))
    renderer = ChatRenderer(tokenizer, tools=request.tools, preamble=request.messages)
    job_ids = renderer.prompt_ids(prompt_messages(prompt, system_prompt=None, conversation=renderer))
    return Capture(request, list(first.prompt_ids), job_ids, result.ended)


def _row_messages(prompt: RawPrompt) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
