"""The gateway's OpenAI-shaped requests and answers: what a request may ask (checked, each refusal an
OpenAI-style 400 naming the field), and a sampled turn as a chat completion, a completion or a stream of
chunks, carrying the exact ids (`prompt_token_ids`, `choices[].token_ids`) and logprobs as vLLM's own
server returns them. The text a parser reads is for the answer only: the trained ids never pass through
a parser.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rldock.runtime.chat.parsers import ReasoningParser, ToolCallParser


class RequestError(ValueError):
    """A request the gateway cannot serve: answered `status` with OpenAI's error body naming `param`."""

    def __init__(self, message: str, *, param: str | None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    """What the gateway reads of a chat completion request (the rest, temperature included, is the job's:
    every turn samples under the job's sampling settings)."""

    messages: list[dict]
    tools: list[dict]
    max_tokens: int | None
    stream: bool
    logprobs: bool
    tool_calls: bool  # tool_choice `auto` (or unset): the answer's tool calls parsed; `none`: left in its text


def check_model(body: Mapping, *, served: Sequence[str]) -> None:
    """`served`: the model names answered (agent.served_models); empty: any name is the policy, as an agent
    written for another provider's model names it."""
    named = body.get("model")
    if named is not None and served and named not in served:
        raise RequestError(
            f"the model {named!r} is not served here; this endpoint serves {', '.join(map(repr, served))} "
            "(agent.served_models)",
            param="model",
        )


def positive_int(body: Mapping, name: str) -> int | None:
    """`body[name]`, a positive integer, or None where unset."""
    value = body.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise RequestError(f"{name} is {value!r}, not a positive integer", param=name)
    return value


def _check_common(body: Any, *, served: Sequence[str]) -> None:
    if not isinstance(body, Mapping):
        raise RequestError("the body is not a JSON object", param=None)
    check_model(body, served=served)
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(f"n is {n!r}: one choice per request (each turn is one sample of the episode)", param="n")
    for name in ("max_tokens", "max_completion_tokens"):
        positive_int(body, name)


def _max_tokens(body: Mapping) -> int | None:
    limits = [body[name] for name in ("max_completion_tokens", "max_tokens") if body.get(name) is not None]
    return min(limits) if limits else None


def tool_calls_allowed(choice: Any, tools: Sequence[Mapping]) -> bool:
    """tool_choice honoured, or refused: `auto` (the default) and `none` are a parsing choice; forcing a call
    (`required`, a named function) needs guided decoding, which the gateway does not run."""
    if choice is None or choice == "auto":
        return True
    if choice == "none":
        return False
    raise RequestError(
        f"tool_choice {choice!r} is not served: forcing a tool call needs guided decoding, which this endpoint "
        "does not run; use `auto` (the model chooses) or `none`",
        param="tool_choice",
    )


def _check_response_format(response_format: Any) -> None:
    if response_format is None or (isinstance(response_format, Mapping) and response_format.get("type") == "text"):
        return
    kind = response_format.get("type") if isinstance(response_format, Mapping) else response_format
    raise RequestError(
        f"response_format {kind!r} is not served: a JSON object or schema needs guided decoding, which this "
        "endpoint does not run; leave it unset (text) and parse the answer",
        param="response_format",
    )


def chat_request(body: Any, *, served: Sequence[str]) -> ChatRequest:
    _check_common(body, served=served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages is not a non-empty list of messages", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{index}] is not an object with a string `role`", param=f"messages[{index}]")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(tool, Mapping) for tool in tools):
        raise RequestError("tools is not a list of objects", param="tools")
    _check_response_format(body.get("response_format"))
    return ChatRequest(
        messages=[dict(message) for message in messages],
        tools=[dict(tool) for tool in tools],
        max_tokens=_max_tokens(body),
        stream=bool(body.get("stream", False)),
        logprobs=bool(body.get("logprobs", False)),
        tool_calls=tool_calls_allowed(body.get("tool_choice"), tools),
    )


def completion_prompt(body: Any, *, served: Sequence[str], vocab_size: int) -> tuple[list[int], int | None]:
    """A completion request's prompt, token ids (one list, each in `[0, vocab_size)`), and its max tokens."""
    _check_common(body, served=served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if (
        not isinstance(prompt, list)
        or not prompt
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        raise RequestError(
            "prompt is not one non-empty list of token ids (text prompts go to chat/completions)", param="prompt"
        )
    outside = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if outside is not None:
        raise RequestError(
            f"prompt holds the token id {outside}, outside the model's vocabulary (0 to {vocab_size - 1})",
            param="prompt",
        )
    if body.get("stream"):
        raise RequestError("stream is not served on completions; use chat/completions", param="stream")
    return list(prompt), _max_tokens(body)


@dataclass(frozen=True)
class Turn:
    """A sampled turn: its ids, each one's logprob (None when not asked), and whether it ended."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] | None
    ended: bool  # with the end-of-turn token; else cut by the length limit


class Shaper:
    """Makes OpenAI answers from sampled turns for one model: its tokenizer, tool-call and reasoning
    formats."""

    def __init__(
        self,
        tokenizer,
        *,
        model: str,
        tool_parser: ToolCallParser,
        reasoning_parser: ReasoningParser,
        served: Sequence[str] = (),
    ):
        """`model`: the name answers carry; `served`: the names requests may give (empty: any)."""
        self.tokenizer, self.model, self.served = tokenizer, model, tuple(served)
        self.tool_parser, self.reasoning_parser = tool_parser, reasoning_parser
        self.eos_text: str = tokenizer.eos_token
        self.vocab_size = len(tokenizer)  # the ids a prompt may hold, added tokens included
        # the most characters one token stands for (its own text's length, added tokens included): a text of
        # C characters is at least C / token_chars tokens (server.py's length check before rendering)
        self.token_chars = max((len(token) for token in tokenizer.get_vocab()), default=1)

    def text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False).removesuffix(self.eos_text)

    def message(self, turn: Turn, *, call_prefix: str, tool_calls: bool = True) -> dict:
        """The assistant message of `turn`: `content`, `reasoning_content` and `tool_calls` parsed from its
        text (a call the model wrote wrong stays in the text; with `tool_calls` False, tool_choice `none`,
        every call does)."""
        reasoning, rest = self.reasoning_parser.split(self.text(turn.token_ids))
        calls = self.tool_parser.parse(rest).calls if turn.ended and tool_calls else ()
        message: dict[str, Any] = {"role": "assistant", "content": self.tool_parser.content(rest) if calls else rest}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if calls:
            message["content"] = message["content"] or None
            message["tool_calls"] = [
                {
                    "id": f"{call_prefix}-{index}",
                    "type": "function",
                    "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
                }
                for index, call in enumerate(calls)
            ]
        return message

    def _logprobs(self, turn: Turn) -> dict | None:
        if turn.logprobs is None:
            return None
        return {
            "content": [
                {
                    "token": self.tokenizer.convert_ids_to_tokens(token),
                    "logprob": logprob,
                    "bytes": None,
                    "top_logprobs": [],
                }
                for token, logprob in zip(turn.token_ids, turn.logprobs)
            ]
        }

    def _answer(self, turn: Turn, *, kind: str, answer_id: str, choice: dict) -> dict:
        prompt, completion = len(turn.prompt_ids), len(turn.token_ids)
        return {
            "id": answer_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "prompt_token_ids": turn.prompt_ids,
            "choices": [{"index": 0, **choice, "token_ids": turn.token_ids}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }

    def chat_completion(self, turn: Turn, message: dict, *, answer_id: str) -> dict:
        finish = "length" if not turn.ended else "tool_calls" if message.get("tool_calls") else "stop"
        choice = {"message": message, "finish_reason": finish, "logprobs": self._logprobs(turn)}
        return self._answer(turn, kind="chat.completion", answer_id=answer_id, choice=choice)

    def completion(self, turn: Turn, *, answer_id: str) -> dict:
        logprobs = None
        if turn.logprobs is not None:
            logprobs = {"token_logprobs": turn.logprobs, "tokens": self.tokenizer.convert_ids_to_tokens(turn.token_ids)}
        choice = {
            "text": self.tokenizer.decode(turn.token_ids, skip_special_tokens=False),
            "finish_reason": "stop" if turn.ended else "length",
            "logprobs": logprobs,
        }
        return self._answer(turn, kind="text_completion", answer_id=answer_id, choice=choice)


def stream_chunks(answer: Mapping) -> Iterator[str]:
    """A chat completion as server-sent events: OpenAI's chunks (the role, the content, the reasoning and
    the calls each as one delta, then the finish reason), then `[DONE]`. A turn is sampled whole before its
    first chunk is sent, so a stream carries the same answer as a plain request."""
    choice = answer["choices"][0]
    message = choice["message"]
    base = {key: answer[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> str:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message.get("reasoning_content"):
        yield chunk({"reasoning_content": message["reasoning_content"]})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, choice["finish_reason"], token_ids=choice["token_ids"], logprobs=choice["logprobs"])
    usage = {**base, "choices": [], "usage": answer["usage"], "prompt_token_ids": answer["prompt_token_ids"]}
    yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"
