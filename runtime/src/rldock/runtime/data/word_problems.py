"""The `word_problems` generator: easy arithmetic told in words, in GSM8K's format.

Each row is a question ("Sam has 3 apples and buys 5 more. How many apples does Sam have now?") and
an answer in GSM8K's shape: a short worked solution, then a line `#### <number>` with the final
answer, so what trains on GSM8K trains on these and the other way round. Templates add, subtract,
multiply and share (divide) small numbers. Rows are a pure function of the seed; no validation
question also appears in the train rows, so validation measures more than recall.

Difficulty is set by `operations` (which templates are drawn), `max_number` (the largest number
added or given away) and `max_factor` (products and shares keep factors up to min(max_factor,
max_number)): a 135M model is partly right on one-digit additions and subtractions, nearly never on
products. With `tool_demonstrations` each row also shows the arithmetic done with that tool
(rldock.runtime.data.demonstrations), ending in the same GSM8K answer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rldock.config.data import GeneratorSpec
from rldock.runtime.data.demonstrations import tool_demonstration
from rldock.runtime.data.rows import GeneratedRows

DATA_SOURCE = "word_problems"
NAMES = ("Sam", "Ana", "Li", "Omar", "Maya", "Tom", "Zoe", "Ravi", "Ella", "Ken")
ITEMS = ("apples", "pencils", "stickers", "books", "marbles", "cookies", "shells", "cards", "coins", "stamps")
# Rejection sampling for distinct validation questions gives up after this many draws per row:
# the template space (about 200k questions) is far larger than any sensible validation set.
DRAWS_PER_ROW = 50

# (rng, name, items, max_number, max_factor) -> (question, worked solution, final answer, the
# arithmetic as a Python expression whose value is the answer)
Template = Callable[[np.random.Generator, str, str, int, int], tuple[str, str, int, str]]


def _number(rng: np.random.Generator, low: int, high: int) -> int:
    return int(rng.integers(low, high + 1))


def _add(rng, name, items, max_number, max_factor):
    a, b = _number(rng, 1, max_number), _number(rng, 1, max_number)
    return (
        f"{name} has {a} {items} and buys {b} more. How many {items} does {name} have now?",
        f"{name} has {a} + {b} = {a + b} {items}.",
        a + b,
        f"{a} + {b}",
    )


def _subtract(rng, name, items, max_number, max_factor):
    a = _number(rng, 3, max_number)
    b = _number(rng, 1, a - 2)  # at least 2 left: every answer reads "<n> <items>" with a plural
    return (
        f"{name} has {a} {items} and gives {b} of them away. How many {items} does {name} have left?",
        f"{name} has {a} - {b} = {a - b} {items} left.",
        a - b,
        f"{a} - {b}",
    )


def _multiply(rng, name, items, max_number, max_factor):
    high = min(max_factor, max_number)
    a, b = _number(rng, 2, high), _number(rng, 2, high)
    return (
        f"{name} has {a} boxes with {b} {items} in each box. How many {items} does {name} have in all?",
        f"{name} has {a} * {b} = {a * b} {items}.",
        a * b,
        f"{a} * {b}",
    )


def _share(rng, name, items, max_number, max_factor):
    high = min(max_factor, max_number)
    each, friends = _number(rng, 2, high), _number(rng, 2, high)
    total = each * friends
    return (
        f"{name} shares {total} {items} equally among {friends} friends. How many {items} does each friend get?",
        f"Each friend gets {total} / {friends} = {each} {items}.",
        each,
        f"{total} // {friends}",  # integer division: Python's `/` would print 6.0
    )


TEMPLATES: dict[str, Template] = {"add": _add, "subtract": _subtract, "multiply": _multiply, "share": _share}


def word_problem(rng: np.random.Generator, spec: GeneratorSpec) -> dict:
    """One row with the logical keys: `prompt` (the question), `answer` (GSM8K: solution + `#### n`),
    and `demonstration` with `spec.tool_demonstrations`."""
    operations = spec.operations
    template = TEMPLATES[operations[int(rng.integers(len(operations)))]]
    name, items = NAMES[int(rng.integers(len(NAMES)))], ITEMS[int(rng.integers(len(ITEMS)))]
    question, solution, result, expression = template(rng, name, items, spec.max_number, spec.max_factor)
    answer = f"{solution}\n#### {result}"
    row: dict[str, object] = {"prompt": question, "answer": answer, "data_source": DATA_SOURCE}
    if spec.tool_demonstrations is not None:
        row["demonstration"] = tool_demonstration(spec.tool_demonstrations, expression, result, answer)
    return row


def generate_word_problems(spec: GeneratorSpec, *, seed: int) -> GeneratedRows:
    rng = np.random.default_rng([seed, 0])
    train = [word_problem(rng, spec) for _ in range(spec.num_prompts)]
    seen = {row["prompt"] for row in train}
    val_rng = np.random.default_rng([seed, 1])
    val: list[dict] = []
    for _ in range(spec.num_val_prompts * DRAWS_PER_ROW):
        if len(val) == spec.num_val_prompts:
            break
        row = word_problem(val_rng, spec)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            val.append(row)
    if len(val) < spec.num_val_prompts:
        raise ValueError(
            f"data.generator.num_val_prompts {spec.num_val_prompts}: found only {len(val)} word problems "
            f"that are not among the {spec.num_prompts} train questions; lower num_val_prompts or num_prompts, "
            "or widen data.generator.operations or max_number (and max_factor for products and shares)"
        )
    return GeneratedRows(train=train, val=val)
