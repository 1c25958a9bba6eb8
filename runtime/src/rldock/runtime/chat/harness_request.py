"""A harness's first request as `rldock agent capture` writes it (`agent.harness_request`): the tools it sends
and the messages before the task's prompt (a system message: the OpenAI Agents SDK's `instructions`), as the
gateway read them.

Why: a harness's prompt is the harness's, not the data's. The gateway renders what the harness sends (its
tools described, its system message), while a job renders each data row alone; a warm-up on demonstrations
after the job's prompt ids then trains after a prompt the policy never sees in an episode (docs/agentic.md,
"A warm-up the gateway agrees with"). With this file the job renders each row as the harness's first
request (these messages, then the row's prompt, these tools), and its prompt ids are the ids the gateway
samples the first turn after.

The file is JSON: `{"tools": [...], "messages": [...]}`, the tools in the chat format (`{"type": "function",
"function": {...}}`; a Responses API request's flat tools as the gateway turns them into chat tools), each
message `{"role", "content"}` with text content.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

FIELD = "agent.harness_request"
FIX = "write it with `rldock agent capture CONFIG --output FILE` (docs/agentic.md#a-warm-up-the-gateway-agrees-with)"


class HarnessRequestError(ValueError):
    """The captured file cannot be read, or a harness's first request cannot be captured; the message says why."""


@dataclass(frozen=True)
class HarnessRequest:
    """The tools and the messages before the task's prompt of a harness's first request."""

    tools: list[dict] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"tools": self.tools, "messages": self.messages}, indent=2, ensure_ascii=False) + "\n"


def read_harness_request(path: str | Path) -> HarnessRequest:
    """The file at `path`, checked; a HarnessRequestError naming agent.harness_request, the file and the fix."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise HarnessRequestError(f"{FIELD}: {path} is not readable JSON ({error}); {FIX}") from None
    problem = _problem(value)
    if problem is not None:
        raise HarnessRequestError(f"{FIELD}: {path} {problem}; {FIX}")
    return HarnessRequest(tools=list(value["tools"]), messages=[dict(message) for message in value["messages"]])


def _problem(value: object) -> str | None:
    if not isinstance(value, Mapping) or set(value) != {"tools", "messages"}:
        keys = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        return f"is not an object of `tools` and `messages` (got {keys})"
    tools, messages = value["tools"], value["messages"]
    if not isinstance(tools, list) or not all(
        isinstance(tool, Mapping) and isinstance(tool.get("function"), Mapping) for tool in tools
    ):
        return "has `tools` that are not a list of chat-format tools ({type: function, function: {...}})"
    if not isinstance(messages, list) or not all(
        isinstance(message, Mapping)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
        for message in messages
    ):
        return "has `messages` that are not a list of {role, content} messages with text content"
    return None


def captured(messages: Sequence[Mapping], tools: Sequence[dict], prompt: Sequence[Mapping]) -> HarnessRequest:
    """What a first request (`messages`, `tools`, as the gateway read them; the messages may go on with the
    turns after it) puts before a task whose prompt is `prompt` (the row's messages): the messages before the
    prompt's first occurrence. A request without the row's prompt (a harness that rewrites or wraps it)
    cannot be rendered from the data, so it is refused, saying so."""
    sent = [{"role": str(message["role"]), "content": str(message.get("content") or "")} for message in messages]
    row = [{"role": str(message["role"]), "content": str(message["content"])} for message in prompt]
    for start in range(len(sent) - len(row) + 1):
        if sent[start : start + len(row)] == row:
            return HarnessRequest(tools=[dict(tool) for tool in tools], messages=sent[:start])
    raise HarnessRequestError(
        f"the harness's first request does not hold the task's prompt ({row!r:.300}; it sent {sent!r:.600}): a "
        "harness that rewrites its task's prompt is rendered from its own text, which the job's data rows cannot "
        "reproduce; give the harness the row's prompt as its input"
    )
