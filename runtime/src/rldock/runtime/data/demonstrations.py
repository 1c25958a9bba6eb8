"""Tool-use demonstrations: a task solved with a tool, as the chat messages that follow its prompt.

A generator with `tool_demonstrations` set writes one per row (column `data.demonstration_key`): the
model's turn calling the tool in the Hermes format the `hermes` parser reads, the tool's reply, and the
final answer in the task's own format. A small instruct model that never calls a tool on its own gives
RL nothing to reinforce; a short warm-up on these (rldock.runtime.driver.warmup) shows it the call, after
which RL decides when a call pays.

The reply is what the built-in tool returns for the call (rldock.runtime.agent.tools): the `python`
tool's stdout, so `print(...)`'s value and a newline, and the `calculator`'s value as text. It is
computed here rather than by running the tool, so generation stays a fast pure function of the seed.
"""

from __future__ import annotations

import json
from typing import Literal

from rldock.runtime.chat.parsers import CLOSE, OPEN

DemonstrationTool = Literal["python", "calculator"]
# The roles a demonstration's messages may have (the prompt holds any system message).
ROLES = ("assistant", "tool", "user")


def tool_call_text(name: str, arguments: dict) -> str:
    """One call in the Hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    return OPEN + json.dumps({"name": name, "arguments": arguments}) + CLOSE


def tool_demonstration(tool: DemonstrationTool, expression: str, value: int, final: str) -> list[dict]:
    """The messages after the prompt that compute `expression` (Python syntax, integer arithmetic) with
    `tool`, read its `value` back and answer `final`."""
    if tool == "python":
        call, reply = tool_call_text("python", {"code": f"print({expression})"}), f"{value}\n"
    else:
        call, reply = tool_call_text("calculator", {"expression": expression}), str(value)
    return [
        {"role": "assistant", "content": call},
        {"role": "tool", "content": reply},
        {"role": "assistant", "content": final},
    ]


def check_demonstration(value: object, *, where: str) -> list[dict]:
    """`value` as a demonstration: a non-empty list of {role, content} messages (string content, a role
    in ROLES) ending with an assistant turn; otherwise a ValueError naming `where` and what is wrong."""
    if not isinstance(value, list) or not value:
        got = "null" if value is None else f"{value!r:.200}"
        raise ValueError(f"{where}: a demonstration must be a non-empty list of chat messages, got {got}")
    for index, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("content"), str)):
            raise ValueError(
                f"{where}: message {index} must be an object with a string `content`, got {message!r:.200}"
            )
        if message.get("role") not in ROLES:
            raise ValueError(
                f"{where}: message {index} has role {message.get('role')!r}; a demonstration's messages "
                f"follow the prompt, so each is one of {', '.join(ROLES)}"
            )
    if value[-1]["role"] != "assistant":
        raise ValueError(
            f"{where}: the last message is a {value[-1]['role']!r} message; a demonstration ends with the "
            "assistant's final answer"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]
