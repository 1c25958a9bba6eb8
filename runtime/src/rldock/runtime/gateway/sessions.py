"""One episode's session of the gateway: the token ids it sampled and the messages it answered, so that
what trains is what the engine sampled, whatever the harness sends back.

A harness speaks chat messages; the engine samples token ids. Rebuilding a trajectory by rendering the
final messages again is not the sampled sequence (a template that drops earlier reasoning, a tokenizer
that merges across a turn boundary, a harness that compacts its context), which breaks the importance
ratios. So the session never re-renders an assistant turn it sampled:

- A request whose messages **extend** the segment's history (the messages of its last request, then the
  assistant message the session answered, unchanged) is the held ids, then the new messages' tokens as
  the chat template writes them after an assistant turn through the next generation prompt
  (ChatRenderer.between_turns: tool results, user turns, each message's text plain text), then the turn.
- **Any other request opens a new segment**, rendered whole from its messages, with a named reason
  (`REASONS`): the tools changed, the system message changed, an earlier message was edited, an answered
  assistant turn came back without its reasoning, an assistant message the session never sampled, fewer
  messages than the history (a compacted context), or the last turn was cut by the length limit (no
  end-of-turn token to continue after).
- A **resend** of a request already answered (the same body) is answered from the record, not sampled
  twice (`recorded`).

Each segment becomes one sample of the dock (`SegmentRow`): the model's tokens trained (`model_mask`),
the prompt and everything between turns context only.

Not thread-safe: the gateway holds a session's lock from `plan` to `commit`, so one request of an
episode is sampled at a time (a harness's parallel calls wait their turn). `plan` renders and tokenizes, so
the gateway runs it on a thread of its pool, off its event loop; `renderer` is called from those threads.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rldock.runtime.chat.conversation import ChatRenderer, markup_ids

# Why a segment began.
START = "start"  # the episode's first request
REASONS = (
    START,
    "tools_changed",  # the request's `tools` are not the segment's
    "system_changed",  # its first (system) message differs
    "reasoning_stripped",  # an answered assistant turn came back without its reasoning
    "message_edited",  # an earlier message (or an answered assistant turn) differs
    "assistant_added",  # an assistant message the session did not sample follows the history
    "compacted",  # fewer messages than the history: a summarised or truncated context
    "length_cut",  # the last turn ended at the length limit, without the end-of-turn token
    "prompt_ids_differ",  # a token-id prompt (/v1/completions) that does not continue the held ids
)
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


@dataclass
class Segment:
    """A run of turns whose token ids are one sequence: `prompt_ids`, then `response_ids`, of which the
    model sampled those where `model_mask` is 1."""

    reason: str
    tools: tuple[str, ...]  # the request's tools, canonical JSON each
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)
    # per response token: the policy version that sampled it (-1 where the model did not) and its logprob then
    # (0.0 where the model did not, or the engine was not asked for logprobs)
    versions: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # per response token: the segment's model turn (0, 1, ...) that sampled it, -1 where the model did not
    turn_index: list[int] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)  # the last request's messages, then the answer
    sampled: list[list[int]] = field(default_factory=list)  # each turn's ids as the engine returned them
    extendable: bool = True  # the last turn ended with the end-of-turn token
    from_ids: bool = False  # a turn came from token ids (/v1/completions): `history` is not its messages

    @property
    def turns(self) -> int:
        return len(self.sampled)

    def add(
        self,
        ids: Sequence[int],
        *,
        model: bool,
        versions: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
    ) -> None:
        self.response_ids.extend(ids)
        self.model_mask.extend([int(model)] * len(ids))
        self.turn_index.extend([self.turns if model else -1] * len(ids))  # `commit` counts the turn after
        self.versions.extend(versions if versions is not None else [-1] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def model_ids(self) -> list[int]:
        """The ids under the model mask, in order: equal to the sampled turns joined when exact."""
        return [token for token, model in zip(self.response_ids, self.model_mask) if model]


@dataclass(frozen=True)
class Plan:
    """What a request becomes: the engine's prompt, and how the session records the turn (`commit`)."""

    reason: str | None  # a new segment's reason; None: the request extends the current segment
    prompt_ids: list[int]  # the whole context the engine continues
    added: list[int]  # context tokens appended to the segment before the turn (the new messages)
    messages: list[dict]  # the request's messages, normalised
    tools: tuple[str, ...]
    from_ids: bool = False  # a token-id prompt (/v1/completions): no messages to keep


@dataclass(frozen=True)
class SegmentRow:
    """A segment as one dock sample: `ids` are the prompt then the response; `prompt_length` of them
    are the prompt; `model_mask` (over the response) marks the sampled tokens, `versions` and `logprobs`
    (over the response) the version that sampled each (-1 elsewhere) and its logprob then (0.0 elsewhere),
    `turn_index` (over the response) the segment's model turn of each (-1 elsewhere)."""

    ids: list[int]
    prompt_length: int
    model_mask: list[int]
    reason: str
    versions: list[int]
    logprobs: list[float]
    turn_index: list[int]


def content_text(content: Any) -> str:
    """A message's `content` as text: a string, None (""), or OpenAI's list of parts (the text parts
    joined; a part of another type is refused, naming it)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"a content part of type {kind!r}: only text parts are served")
            texts.append(part["text"])
        return "".join(texts)
    raise ValueError(f"content is a {type(content).__name__}, not a string or a list of text parts")


def _arguments(value: Any) -> Any:
    """A tool call's arguments as a value: OpenAI sends them as a JSON string."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _calls(message: Mapping) -> list[tuple[str, Any]]:
    return [
        (str(call.get("function", {}).get("name")), _arguments(call.get("function", {}).get("arguments")))
        for call in message.get("tool_calls") or []
    ]


def normalised(message: Mapping) -> dict:
    """A request message as the session keeps it: `content` text; the other keys as sent."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ValueError("a message is an object with a string `role`")
    return {**message, "content": content_text(message.get("content"))}


def _same(held: Mapping, sent: Mapping) -> bool:
    """Whether a message the harness sent back is the one the session holds. An assistant turn: the same
    text and calls (name and arguments; ids and any other key aside), and the same reasoning unless the
    harness left `reasoning_content` out (clients drop fields they do not know); another message: the same
    role, text, `tool_call_id` and `name`."""
    if held["role"] != sent["role"] or held["content"] != sent["content"]:
        return False
    if held["role"] == "assistant":
        reasoning = sent.get("reasoning_content")
        return _calls(held) == _calls(sent) and (reasoning is None or reasoning == held.get("reasoning_content"))
    return all(held.get(key) == sent.get(key) for key in ("tool_call_id", "name"))


def _stripped(held: Mapping, sent: Mapping) -> bool:
    """Whether `sent` is the held assistant turn with its reasoning taken out: its `<think>` block cut from
    the text, or its `reasoning_content` emptied."""
    if held["role"] != "assistant" or sent["role"] != "assistant" or _calls(held) != _calls(sent):
        return False
    cut_text = _THINK.sub("", held["content"]) != held["content"] and _THINK.sub("", held["content"]) == sent["content"]
    emptied = (
        bool(held.get("reasoning_content"))
        and sent.get("reasoning_content") == ""
        and held["content"] == sent["content"]
    )
    return cut_text or emptied


def divergence(segment: Segment, messages: Sequence[dict], tools: tuple[str, ...]) -> str | None:
    """Why `messages` (normalised) with `tools` cannot extend `segment`; None when they do."""
    history = segment.history
    if tools != segment.tools:
        return "tools_changed"
    for index, (held, sent) in enumerate(zip(history, messages)):
        if _same(held, sent):
            continue
        if index == 0 and "system" in (held["role"], sent["role"]):
            return "system_changed"
        return "reasoning_stripped" if _stripped(held, sent) else "message_edited"
    if len(messages) <= len(history):
        return "compacted"
    if any(message["role"] == "assistant" for message in messages[len(history) :]):
        return "assistant_added"
    if not segment.extendable:
        return "length_cut"
    return None


def request_digest(body: Mapping) -> str:
    """The key of a request's body for answering a resend from the record: its canonical JSON."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class Session:
    """One episode's segments and answered requests. `renderer(tools)` is the chat template's renderer for a
    request's tools (OpenAI's function format; the gateway caches one per distinct list)."""

    def __init__(self, renderer: Callable[[Sequence[dict]], ChatRenderer]):
        self.renderer = renderer
        self.segments: list[Segment] = []
        self._answers: dict[str, Any] = {}  # request digest -> the answer given

    def latest_turn(self) -> tuple[int, int] | None:
        """(segment, turn within it) of the last model turn recorded, None before the first: the turn a
        reward posted now follows."""
        if not self.segments:
            return None
        return len(self.segments) - 1, self.segments[-1].turns - 1

    def recorded(self, digest: str) -> Any | None:
        """The answer already given to the request of `digest`, or None."""
        return self._answers.get(digest)

    def record(self, digest: str, answer: Any) -> None:
        self._answers[digest] = answer

    def plan(self, messages: Sequence[Mapping], tools: Sequence[dict] = ()) -> Plan:
        """What the request's turn samples after: the held ids and the new messages' tokens when it extends
        the current segment, else its messages rendered whole as a new segment's prompt."""
        kept = [normalised(message) for message in messages]
        if not kept:
            raise ValueError("messages is empty")
        canonical = tuple(json.dumps(tool, sort_keys=True) for tool in tools)
        renderer = self.renderer(list(tools))
        reason = divergence(self.segments[-1], kept, canonical) if self.segments else START
        if reason is None:
            segment = self.segments[-1]
            added = renderer.between_turns(kept[len(segment.history) :])
            return Plan(None, [*segment.prompt_ids, *segment.response_ids, *added], added, kept, canonical)
        return Plan(reason, renderer.prompt_ids(kept), [], kept, canonical)

    def plan_ids(self, prompt_ids: Sequence[int]) -> Plan:
        """A token-id prompt's plan: it extends the current segment when the held ids are a proper prefix
        of it (the rest is context), else it opens a segment as it is."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if not self.segments:
            return Plan(START, list(prompt_ids), [], [], (), from_ids=True)
        segment = self.segments[-1]
        held = [*segment.prompt_ids, *segment.response_ids]
        if len(prompt_ids) > len(held) and list(prompt_ids[: len(held)]) == held:
            return Plan(None, list(prompt_ids), list(prompt_ids[len(held) :]), [], segment.tools, from_ids=True)
        return Plan("prompt_ids_differ", list(prompt_ids), [], [], (), from_ids=True)

    def commit(
        self,
        plan: Plan,
        token_ids: Sequence[int],
        *,
        ended_turn: bool,
        answer: Mapping,
        versions: Sequence[int] | None = None,
        logprobs: Sequence[float] | None = None,
    ) -> Segment:
        """Record the turn the engine sampled for `plan` (`token_ids`, the end-of-turn token included when
        `ended_turn`; each one's policy version and logprob when sampled, -1 and 0.0 when not given) and the
        assistant message answered from it."""
        if plan.reason is not None:
            self.segments.append(Segment(plan.reason, plan.tools, list(plan.prompt_ids)))
        segment = self.segments[-1]
        segment.add(plan.added, model=False)
        segment.add(token_ids, model=True, versions=versions, logprobs=logprobs)
        segment.sampled.append(list(token_ids))
        segment.history = [*plan.messages, normalised(answer)]
        segment.extendable = ended_turn
        segment.from_ids = segment.from_ids or plan.from_ids
        return segment

    def rows(self, *, prompt_capacity: int) -> list[SegmentRow]:
        """Each segment as a dock sample; a prompt longer than `prompt_capacity` (the dock's prompt
        width) continues in the response as context, so the row's ids are still the segment's."""
        rows = []
        for segment in self.segments:
            ids = [*segment.prompt_ids, *segment.response_ids]
            prompt_length = min(len(segment.prompt_ids), prompt_capacity)
            spill = len(segment.prompt_ids) - prompt_length
            rows.append(
                SegmentRow(
                    ids,
                    prompt_length,
                    [0] * spill + segment.model_mask,
                    segment.reason,
                    [-1] * spill + segment.versions,
                    [0.0] * spill + segment.logprobs,
                    [-1] * spill + segment.turn_index,
                )
            )
        return rows


@dataclass(frozen=True)
class Drift:
    """What rendering a segment's final messages again would have given, against the ids it holds."""

    drifted: bool  # the held ids are not a prefix of the re-rendered ones
    tokens: int  # held ids past the longest common prefix


def rerendered_drift(segment: Segment, renderer: ChatRenderer) -> Drift:
    """Render the segment's final messages (its history, the last answer included) whole, as a trainer
    that rebuilds trajectories from messages would, and compare with the ids held (the debug report)."""
    held = [*segment.prompt_ids, *segment.response_ids]
    tools = [json.loads(tool) for tool in segment.tools] or None
    text = renderer.tokenizer.apply_chat_template(renderer.with_tools(segment.history), tools=tools, tokenize=False)
    rendered = markup_ids(renderer.tokenizer, text)
    common = 0
    for a, b in zip(held, rendered):
        if a != b:
            break
        common += 1
    return Drift(common < len(held), len(held) - common)
