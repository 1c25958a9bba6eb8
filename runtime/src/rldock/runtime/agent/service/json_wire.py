"""JSON as it crosses between an environment server and its clients, read within limits: both sides
parse what the other sent with `loads`, which refuses what Python's `json.loads` would take but a peer
should not send (NaN and Infinity, a float that overflows to inf, an integer of more than
MAX_INT_DIGITS digits, nesting deeper than MAX_DEPTH) with a ValueError, where `json.loads` would raise
a RecursionError, spend quadratic time on a long integer or hand back a value the trainer cannot keep.

The size of what is parsed is bounded before it gets here: by the WebSocket's `max_size` (the
decompressed message) and by the server's body limit.
"""

from __future__ import annotations

import json
import math
from typing import Any

MAX_DEPTH = 64  # arrays and objects nested in each other
MAX_INT_DIGITS = 64  # an integer's digits (a seed is 10, a 64-bit number 20)
# The largest message either side reads, decompressed: a WebSocket frame or an HTTP body. An observation
# the model reads is cut to agent.max_tool_response_tokens anyway; this bounds what a peer can make the
# other hold before that.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class WireError(ValueError):
    """What a peer sent is not JSON within the limits; the message says which."""


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise WireError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise WireError(f"a number out of range: {text[:40]}")
    return value


def _constant(text: str) -> Any:
    raise WireError(f"{text} is not JSON")


def depth(value: Any) -> int:
    """How deeply arrays and objects nest in `value` (a scalar: 0), walked without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if level > MAX_DEPTH:
            break  # deep enough to refuse; no need to walk the rest
        stack.extend((child, level + 1) for child in children)
    return deepest


def loads(raw: str | bytes) -> Any:
    """`raw` parsed as JSON within this module's limits; WireError (a ValueError) says what is wrong."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise WireError(f"not UTF-8: {error}") from error
    if len(raw) > MAX_MESSAGE_BYTES:
        raise WireError(f"{len(raw)} characters (at most {MAX_MESSAGE_BYTES} bytes)")
    try:
        value = json.loads(raw, parse_int=_integer, parse_float=_float, parse_constant=_constant)
    except RecursionError as error:  # the C parser's guard on very deep nesting
        raise WireError(f"nested deeper than {MAX_DEPTH}") from error
    except WireError:
        raise
    except ValueError as error:  # json.JSONDecodeError included
        raise WireError(f"invalid JSON: {error}") from error
    if depth(value) > MAX_DEPTH:
        raise WireError(f"nested deeper than {MAX_DEPTH}")
    return value
