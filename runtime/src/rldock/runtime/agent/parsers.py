"""Tool-call parsers: the tool calls a decoded generation makes, by the format the model was trained on
(`agent.tool_call_format`).

A call the model got wrong is never an exception: it becomes a `malformed` message that says what is
wrong and how a call is written, which the rollout loop answers to the model as a tool error (and
counts), so the policy can learn the format from its own mistakes.
"""

from __future__ import annotations

import json
from typing import Any

from rldock.runtime.agent.base import TOOL_CALL_PARSERS, ParsedTurn, ToolCall, ToolCallParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES_EXAMPLE = '<tool_call>{"name": "...", "arguments": {...}}</tool_call>'


@TOOL_CALL_PARSERS.register("hermes")
class HermesParser(ToolCallParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes, Qwen2.5 and Qwen3 write
    calls; any number in one generation, whitespace around the JSON allowed. `arguments` may also be a
    JSON string that holds an object (some models write it so). Text outside the tags is ignored, and a
    generation with no opening tag is a final answer."""

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        malformed: list[str] = []
        start = text.find(OPEN)
        number = 0
        while start != -1:
            number += 1
            body_start = start + len(OPEN)
            end, following = text.find(CLOSE, body_start), text.find(OPEN, body_start)
            if end == -1 or (following != -1 and following < end):
                # Unclosed: everything up to the next opening tag (or the end) was meant as this call.
                malformed.append(f"tool call {number} has no closing {CLOSE}; write {HERMES_EXAMPLE}")
                start = following
                continue
            parsed = _call(text[body_start:end])
            if isinstance(parsed, ToolCall):
                calls.append(parsed)
            else:
                malformed.append(f"tool call {number} {parsed}; write {HERMES_EXAMPLE}")
            start = text.find(OPEN, end + len(CLOSE))
        return ParsedTurn(calls=tuple(calls), malformed=tuple(malformed))


def _call(body: str) -> ToolCall | str:
    """The call written between the tags, or what is wrong with it (to follow "tool call N")."""
    value = _json(body)
    if isinstance(value, str):
        return value
    (decoded,) = value
    if not isinstance(decoded, dict):
        return f"is a JSON {_json_type(decoded)}, not an object"
    name = decoded.get("name")
    if not isinstance(name, str) or not name.strip():
        return 'has no "name" (the tool\'s name, a string)'
    if "arguments" not in decoded:
        return 'has no "arguments" (an object; {} for a tool without arguments)'
    arguments = decoded["arguments"]
    if isinstance(arguments, str):  # an object written as a JSON string
        inner = _json(arguments)
        arguments = inner[0] if isinstance(inner, tuple) else None
    if not isinstance(arguments, dict):
        return f'has "arguments" that are not a JSON object (for {name!r})'
    return ToolCall(name=name.strip(), arguments=arguments)


def _json(text: str) -> tuple[Any] | str:
    """(the decoded value,), or what is wrong with the text as JSON."""
    try:
        return (json.loads(text),)
    except json.JSONDecodeError as error:
        return f"is not valid JSON: {error.msg} (line {error.lineno} column {error.colno})"
    except (ValueError, RecursionError) as error:  # an integer of over 4300 digits; nesting past the stack
        return f"is not valid JSON: {type(error).__name__}"


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    return "null" if value is None else "number"
