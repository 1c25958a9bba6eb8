"""The Responses API (`POST .../v1/responses`), the OpenAI Agents SDK's default model interface, served as a
chat turn: a request's input items become chat messages (the same session, renderer and exact ids as
chat/completions), and the sampled assistant message becomes the response's output items.

What a request may send, and what each becomes:
- `input`: a string (one user message) or a list of items: messages (`role` user, system, developer, which
  is a system message, or assistant; `content` a string or `input_text`/`output_text` parts),
  `function_call` items (the assistant's tool calls: consecutive ones, after the assistant's message of
  the same turn, are that one message's `tool_calls`), `function_call_output` items (tool messages) and
  `reasoning` items (the next assistant message's reasoning). Images, files and other item types: 400.
- `instructions`: a system message before the conversation (not carried over from a previous response,
  as OpenAI's API does not).
- `previous_response_id`: the conversation of that response of this episode (its input and output) goes
  before this request's input; an id this episode did not answer: 400.
- `tools`: function tools (`{"type": "function", "name", "description", "parameters"}`); hosted tools
  (web search, file search, ...): 400 naming the tool, since no one runs them here.
- `tool_choice`, `max_output_tokens`, `model`: as chat/completions (`auto` and `none` honoured, a forced
  call refused; any model name served unless agent.served_models lists names). `text.format` other than
  text: 400 (it needs guided decoding). Sampling settings (temperature, top_p, ...), `store`,
  `metadata`, `truncation`, `parallel_tool_calls`: the job's own settings hold, as in chat/completions.
- `stream`: the response as OpenAI's server-sent events, sampled whole first (the same answer either way).

The answer carries `prompt_token_ids` and `token_ids` beside OpenAI's fields, as chat completions do.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rldock.runtime.gateway.answers import (
    ChatRequest,
    RequestError,
    Turn,
    check_model,
    positive_int,
    tool_calls_allowed,
)

TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


@dataclass(frozen=True)
class ResponsesRequest:
    """A responses request read: the turn as a chat request over the whole conversation, and the
    conversation without the instructions (what a later `previous_response_id` continues)."""

    chat: ChatRequest
    conversation: list[dict]
    body: Mapping[str, Any]


def responses_request(
    body: Any, *, served: Sequence[str], previous: Callable[[str], list[dict] | None]
) -> ResponsesRequest:
    """`previous(id)`: the conversation of this episode's response `id` (input and output), or None."""
    if not isinstance(body, Mapping):
        raise RequestError("the body is not a JSON object", param=None)
    check_model(body, served=served)
    raw = body.get("input")
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise RequestError("input is not a string or a non-empty list of items", param="input")
    conversation: list[dict] = []
    earlier = body.get("previous_response_id")
    if earlier is not None:
        held = previous(earlier) if isinstance(earlier, str) else None
        if held is None:
            raise RequestError(
                f"previous_response_id {earlier!r} is not a response of this episode", param="previous_response_id"
            )
        conversation = [dict(message) for message in held]
    conversation += input_messages(raw)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions is not a string", param="instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    tools = chat_tools(body.get("tools") or [])
    text = body.get("text")
    format_ = text.get("format") if isinstance(text, Mapping) else None
    if format_ is not None and not (isinstance(format_, Mapping) and format_.get("type") == "text"):
        kind = format_.get("type") if isinstance(format_, Mapping) else format_
        raise RequestError(
            f"text.format {kind!r} is not served: a JSON object or schema needs guided decoding, which this "
            "endpoint does not run; leave it unset (text) and parse the answer",
            param="text.format",
        )
    chat = ChatRequest(
        messages=messages,
        tools=tools,
        max_tokens=positive_int(body, "max_output_tokens"),
        stream=bool(body.get("stream", False)),
        logprobs=False,
        tool_calls=tool_calls_allowed(body.get("tool_choice"), tools),
    )
    return ResponsesRequest(chat=chat, conversation=conversation, body=body)


def input_messages(items: list) -> list[dict]:
    """Chat messages of a responses `input` list (module docstring)."""
    messages: list[dict] = []
    reasoning: str | None = None
    calls_open = False  # the last message is the assistant's, and tool calls of its turn may follow
    for index, item in enumerate(items):
        at = f"input[{index}]"
        if not isinstance(item, Mapping):
            raise RequestError(f"{at} is not an object", param=at)
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise RequestError(f"{at}.role is {item.get('role')!r}, not one of {sorted(ROLES)}", param=f"{at}.role")
            message: dict[str, Any] = {"role": role, "content": _text(item.get("content"), f"{at}.content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
            calls_open = role == "assistant"
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", at),
                "type": "function",
                "function": {"name": _string(item, "name", at), "arguments": _string(item, "arguments", at)},
            }
            if not calls_open:
                messages.append({"role": "assistant", "content": None})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
                calls_open = True
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _text(output, f"{at}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", at), "content": content})
            calls_open = False
        elif kind == "reasoning":
            summary = item.get("summary") or []
            reasoning = "".join(part.get("text", "") for part in summary if isinstance(part, Mapping))
        else:
            raise RequestError(
                f"{at}.type {kind!r} is not served: messages, function_call, function_call_output and reasoning "
                "items are",
                param=f"{at}.type",
            )
    return messages


def chat_tools(tools: Any) -> list[dict]:
    """Chat-format tools of the Responses API's flat function tools; a hosted tool is refused."""
    if not isinstance(tools, list):
        raise RequestError("tools is not a list of objects", param="tools")
    found = []
    for index, tool in enumerate(tools):
        at = f"tools[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, Mapping) else tool
            raise RequestError(
                f"{at} is a {kind!r} tool: only function tools are served (a hosted tool has no one to run it "
                "here); give the harness a function tool that does its work",
                param=at,
            )
        function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
        if not isinstance(function.get("name"), str):
            raise RequestError(f"{at}.name is not a string", param=f"{at}.name")
        found.append({"type": "function", "function": function})
    return found


def _text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{at} is not a string or a list of text parts", param=at)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else part
            raise RequestError(f"{at}[{index}] is a {kind!r} part: text parts only are served", param=f"{at}[{index}]")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: Mapping, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{at}.{key} is not a string", param=f"{at}.{key}")
    return value


def response(turn: Turn, message: dict, *, answer_id: str, model: str, request: ResponsesRequest) -> dict:
    """The Responses API object of a sampled turn whose assistant message is `message` (Shaper.message)."""
    body = request.body
    output: list[dict] = []
    if message.get("reasoning_content"):
        summary = [{"type": "summary_text", "text": message["reasoning_content"]}]
        output.append({"type": "reasoning", "id": f"rs-{answer_id}", "summary": summary})
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": message.get("content") or "", "annotations": []}
        item = {"type": "message", "id": f"msg-{answer_id}", "status": "completed", "role": "assistant"}
        output.append({**item, "content": [part]})
    for call in calls:
        function = call["function"]
        output.append(
            {
                "type": "function_call",
                "id": f"fc-{call['id']}",
                "call_id": call["id"],
                "name": function["name"],
                "arguments": function["arguments"],
                "status": "completed",
            }
        )
    prompt, completion = len(turn.prompt_ids), len(turn.token_ids)
    return {
        "id": answer_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed" if turn.ended else "incomplete",
        "incomplete_details": None if turn.ended else {"reason": "max_output_tokens"},
        "error": None,
        "model": model,
        "output": output,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": True,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "temperature": None,
        "top_p": None,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
        "prompt_token_ids": turn.prompt_ids,
        "token_ids": turn.token_ids,
    }


def stream_events(answer: Mapping) -> Iterator[str]:
    """A response as OpenAI's server-sent events: created, each output item added, its text or arguments
    as one delta, done, then completed. The turn is sampled whole before the first event."""
    number = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal number
        number += 1
        body = {"type": kind, "sequence_number": number - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    started = {**answer, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(answer["output"]):
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index, item={**item, "content": []})
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            yield event("response.content_part.added", **where, part={**part, "text": ""})
            yield event("response.output_text.delta", **where, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **where, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **where, part=part)
        elif item["type"] == "function_call":
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            where = {"item_id": item["id"], "output_index": index}
            yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        else:
            yield event("response.output_item.added", output_index=index, item=item)
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.completed" if answer["status"] == "completed" else "response.incomplete", response=answer)
