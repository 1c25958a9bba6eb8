"""The `word_problems` generator: easy arithmetic told in words, in GSM8K's format.

Each row is a question ("Sam has 3 apples and buys 5 more. How many apples does Sam have now?") and
an answer in GSM8K's shape: a short worked solution, then a line `#### <number>` with the final
answer, so what trains on GSM8K trains on these and the other way round. Templates add, subtract,
multiply and share (divide) small numbers. Rows are a pure function of the seed; no validation
question also appears in the train rows, so validation measures more than recall.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from rldock.config.job import GeneratorSpec
from rldock.runtime.data.rows import GeneratedRows

DATA_SOURCE = "word_problems"
NAMES = ("Sam", "Ana", "Li", "Omar", "Maya", "Tom", "Zoe", "Ravi", "Ella", "Ken")
ITEMS = ("apples", "pencils", "stickers", "books", "marbles", "cookies", "shells", "cards", "coins", "stamps")
MAX_NUMBER = 20
# Rejection sampling for distinct validation questions gives up after this many draws per row:
# the template space (about 200k questions) is far larger than any sensible validation set.
DRAWS_PER_ROW = 50

# (rng, name, items) -> (question, worked solution, final answer)
Template = Callable[[np.random.Generator, str, str], tuple[str, str, int]]


def _number(rng: np.random.Generator, low: int = 1, high: int = MAX_NUMBER) -> int:
    return int(rng.integers(low, high + 1))


def _add(rng, name, items):
    a, b = _number(rng), _number(rng)
    return (f"{name} has {a} {items} and buys {b} more. How many {items} does {name} have now?",
            f"{name} has {a} + {b} = {a + b} {items}.", a + b)


def _subtract(rng, name, items):
    a = _number(rng, 3)
    b = _number(rng, 1, a - 2)  # at least 2 left: every answer reads "<n> <items>" with a plural
    return (f"{name} has {a} {items} and gives {b} of them away. How many {items} does {name} have left?",
            f"{name} has {a} - {b} = {a - b} {items} left.", a - b)


def _multiply(rng, name, items):
    a, b = _number(rng, 2, 10), _number(rng, 2, 10)
    return (f"{name} has {a} boxes with {b} {items} in each box. How many {items} does {name} have in all?",
            f"{name} has {a} * {b} = {a * b} {items}.", a * b)


def _share(rng, name, items):
    each, friends = _number(rng, 2, 10), _number(rng, 2, 10)
    total = each * friends
    return (f"{name} shares {total} {items} equally among {friends} friends. How many {items} does each "
            "friend get?", f"Each friend gets {total} / {friends} = {each} {items}.", each)


TEMPLATES: tuple[Template, ...] = (_add, _subtract, _multiply, _share)


def word_problem(rng: np.random.Generator) -> dict:
    """One row with the logical keys: `prompt` (the question), `answer` (GSM8K: solution + `#### n`)."""
    template = TEMPLATES[int(rng.integers(len(TEMPLATES)))]
    name, items = NAMES[int(rng.integers(len(NAMES)))], ITEMS[int(rng.integers(len(ITEMS)))]
    question, solution, result = template(rng, name, items)
    return {"prompt": question, "answer": f"{solution}\n#### {result}", "data_source": DATA_SOURCE}


def generate_word_problems(spec: GeneratorSpec, *, seed: int) -> GeneratedRows:
    rng = np.random.default_rng([seed, 0])
    train = [word_problem(rng) for _ in range(spec.num_prompts)]
    seen = {row["prompt"] for row in train}
    val_rng = np.random.default_rng([seed, 1])
    val: list[dict] = []
    for _ in range(spec.num_val_prompts * DRAWS_PER_ROW):
        if len(val) == spec.num_val_prompts:
            break
        row = word_problem(val_rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            val.append(row)
    if len(val) < spec.num_val_prompts:
        raise ValueError(
            f"data.generator.num_val_prompts {spec.num_val_prompts}: found only {len(val)} word problems "
            f"that are not among the {spec.num_prompts} train questions; lower num_val_prompts or num_prompts")
    return GeneratedRows(train=train, val=val)
