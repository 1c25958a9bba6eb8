"""Tool-call parsers: the tool calls a decoded generation makes, by the format the model was trained on
(`agent.tool_call_format`).

A call the model got wrong is never an exception: it becomes a `malformed` message that says what is
wrong and how a call is written, which the rollout loop answers to the model as a tool error (and
counts), so the policy can learn the format from its own mistakes.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rldock.runtime.registry import Registry


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """A generation's tool calls in order, and the calls it tried to write but got wrong (a message for
    each, which the model is told as a tool error)."""

    calls: tuple[ToolCall, ...] = ()
    malformed: tuple[str, ...] = ()

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.malformed)


class ToolCallParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> ParsedTurn:
        """The tool calls in one decoded generation (special tokens kept)."""

    def content(self, text: str) -> str:
        """The generation's text without its calls: what an OpenAI-shaped answer's `content` says."""
        return text


# name -> the built-in class; a user's own parser loads from its reference (agent/builders.py).
TOOL_CALL_PARSERS: Registry[type[ToolCallParser]] = Registry("tool call format", field="agent.tool_call_format")

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

    def content(self, text: str) -> str:
        return _without_blocks(text, OPEN, CLOSE)


def _without_blocks(text: str, open_tag: str, close_tag: str) -> str:
    """`text` without its `open_tag`...`close_tag` blocks (an unclosed one runs to the end), stripped."""
    kept, rest = [], text
    while (start := rest.find(open_tag)) != -1:
        kept.append(rest[:start])
        end = rest.find(close_tag, start + len(open_tag))
        rest = "" if end == -1 else rest[end + len(close_tag) :]
    return "".join([*kept, rest]).strip()


QWEN3_CODER_EXAMPLE = (
    "<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nvalue\n</parameter>\n</function>\n</tool_call>"
)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@TOOL_CALL_PARSERS.register("qwen3_coder")
class Qwen3CoderParser(ToolCallParser):
    """Qwen3-Coder's XML calls: `<tool_call><function=NAME><parameter=ARG>value</parameter>...</function>
    </tool_call>`, any number in one generation. A value that reads as JSON (a number, an object, true) is
    that value, any other is its text, as Qwen's own parser takes it."""

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        malformed: list[str] = []
        for number, block in enumerate(_blocks(text, OPEN, CLOSE), start=1):
            if block is None:
                malformed.append(f"tool call {number} has no closing {CLOSE}; write {QWEN3_CODER_EXAMPLE}")
                continue
            function = _FUNCTION.search(block)
            if function is None:
                malformed.append(
                    f"tool call {number} has no <function=NAME>...</function>; write {QWEN3_CODER_EXAMPLE}"
                )
                continue
            arguments = {name.strip(): _xml_value(value) for name, value in _PARAMETER.findall(function.group(2))}
            calls.append(ToolCall(name=function.group(1).strip(), arguments=arguments))
        return ParsedTurn(calls=tuple(calls), malformed=tuple(malformed))

    def content(self, text: str) -> str:
        return _without_blocks(text, OPEN, CLOSE)


def _blocks(text: str, open_tag: str, close_tag: str) -> list[str | None]:
    """The bodies of `text`'s `open_tag`...`close_tag` blocks in order; None for one never closed."""
    bodies: list[str | None] = []
    start = text.find(open_tag)
    while start != -1:
        body_start = start + len(open_tag)
        end, following = text.find(close_tag, body_start), text.find(open_tag, body_start)
        if end == -1 or (following != -1 and following < end):
            bodies.append(None)
            start = following
            continue
        bodies.append(text[body_start:end])
        start = text.find(open_tag, end + len(close_tag))
    return bodies


def _xml_value(text: str) -> Any:
    value = _json(text.strip())
    return value[0] if isinstance(value, tuple) else text


PYTHON_TAG = "<|python_tag|>"
LLAMA3_EXAMPLE = '{"name": "...", "parameters": {...}}'


@TOOL_CALL_PARSERS.register("llama3_json")
class Llama3JsonParser(ToolCallParser):
    """Llama 3.1-3.3's JSON calls: the whole turn is `{"name": ..., "parameters": {...}}` (or several joined
    by `;`), after an optional `<|python_tag|>`. A turn that does not open with `{` (after the tag) is a final
    answer; one that does but is not such an object is a malformed call."""

    def parse(self, text: str) -> ParsedTurn:
        body = self._body(text)
        if body is None:
            return ParsedTurn()
        calls: list[ToolCall] = []
        malformed: list[str] = []
        for number, part in enumerate(_split_objects(body), start=1):
            value = _json(part)
            decoded = value[0] if isinstance(value, tuple) else None
            if isinstance(decoded, dict) and "parameters" in decoded and "arguments" not in decoded:
                decoded = {"name": decoded.get("name"), "arguments": decoded["parameters"]}
            parsed = _call(json.dumps(decoded)) if decoded is not None else value
            if isinstance(parsed, ToolCall):
                calls.append(parsed)
            else:
                malformed.append(f"tool call {number} {parsed}; write {LLAMA3_EXAMPLE}")
        return ParsedTurn(calls=tuple(calls), malformed=tuple(malformed))

    def content(self, text: str) -> str:
        return text if self._body(text) is None else ""

    @staticmethod
    def _body(text: str) -> str | None:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        for end in ("<|eot_id|>", "<|eom_id|>"):
            body = body.removesuffix(end).strip()
        return body if body.startswith("{") else None


def _split_objects(body: str) -> list[str]:
    """`body` split at the `;` between top-level JSON objects (a `;` inside a string stays)."""
    parts, depth, quoted, escaped, start = [], 0, False, False, 0
    for index, char in enumerate(body):
        if quoted:
            escaped, quoted = (not escaped and char == "\\"), quoted and (escaped or char != '"')
            continue
        if char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == ";" and depth == 0:
            parts.append(body[start:index].strip())
            start = index + 1
    parts.append(body[start:].strip())
    return [part for part in parts if part]


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


class ReasoningParser(ABC):
    """Splits a generation's text into the model's reasoning and its answer (`agent.reasoning_format`)."""

    @abstractmethod
    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning, None where the text has none; the rest of the text)."""


REASONING_PARSERS: Registry[type[ReasoningParser]] = Registry("reasoning format", field="agent.reasoning_format")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@REASONING_PARSERS.register("none")
class NoReasoning(ReasoningParser):
    """The whole text is the answer."""

    def split(self, text: str) -> tuple[str | None, str]:
        return None, text


@REASONING_PARSERS.register("think")
class ThinkReasoning(ReasoningParser):
    """`<think>...</think>` before the answer (Qwen3, DeepSeek-R1, QwQ). A text with `</think>` but no
    `<think>` had it opened by the template's generation prompt: all before the close is reasoning. A text
    whose `<think>` is never closed (cut by the length limit) is all reasoning."""

    def split(self, text: str) -> tuple[str | None, str]:
        opened = text.find(THINK_OPEN)
        closed = text.find(THINK_CLOSE)
        if closed == -1:
            if opened == -1:
                return None, text
            return text[opened + len(THINK_OPEN) :].strip(), text[:opened].strip()
        start = opened + len(THINK_OPEN) if 0 <= opened < closed else 0
        return text[start:closed].strip(), text[closed + len(THINK_CLOSE) :].strip()
