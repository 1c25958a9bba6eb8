"""The `addition` generator: prompts like "37+58=" whose reference answer is "95".

Operands are drawn uniformly from 0..max_operand (with replacement, so small operand ranges repeat
prompts); the train rows are exactly the prompts the former `addition` task drew from the same
seed, so the demo learns as before. The prompt ends with "=", so a model trained on prompt +
answer + EOS learns to write the sum right after the prompt and stop. Validation rows come from a
second stream of the same seed (with few operands they repeat train prompts: there are only
(max_operand + 1)^2 of them).

With `tool_demonstrations` each row also shows the sum computed with that tool
(rldock.runtime.data.demonstrations), then the sum as the answer.

For preference training (DPO) each row also has a pair: chosen = the sum, rejected = the sum with
one digit replaced by another, so both have the same length and differ only in correctness (a
length difference would give the preference an easier, meaningless cue).
"""

from __future__ import annotations

import numpy as np

from rldock.config.data import GeneratorSpec
from rldock.runtime.data.demonstrations import tool_demonstration
from rldock.runtime.data.rows import GeneratedRows

DATA_SOURCE = "addition"


def generate_addition(spec: GeneratorSpec, *, seed: int) -> GeneratedRows:
    return GeneratedRows(
        train=_rows(np.random.default_rng(seed), spec.num_prompts, spec, seed=seed),
        val=_rows(np.random.default_rng([seed, 1]), spec.num_val_prompts, spec, seed=seed + 1),
    )


def _rows(rng: np.random.Generator, num_rows: int, spec: GeneratorSpec, *, seed: int) -> list[dict]:
    operands = rng.integers(0, spec.max_operand + 1, size=(num_rows, 2))  # (P, 2)
    tool = spec.tool_demonstrations
    rows = []
    for i, (a, b) in enumerate(operands.tolist()):
        answer = str(a + b)
        # The wrong answer depends only on (seed, row), as the former task's pairs did.
        wrong = wrong_answer(answer, np.random.default_rng([seed, i]))
        row: dict[str, object] = {"prompt": f"{a}+{b}=", "answer": answer, "data_source": DATA_SOURCE}
        row |= {"chosen": answer, "rejected": wrong}
        if tool is not None:
            row["demonstration"] = tool_demonstration(tool, f"{a} + {b}", a + b, answer)
        rows.append(row)
    return rows


def wrong_answer(answer: str, rng: np.random.Generator) -> str:
    """`answer` (digits) with one digit, picked by `rng`, replaced by a different digit; a leading
    digit of a multi-digit answer never becomes 0, so the result still reads as a number."""
    position = int(rng.integers(len(answer)))
    lowest = 1 if position == 0 and len(answer) > 1 else 0
    choices = [str(d) for d in range(lowest, 10) if str(d) != answer[position]]
    return answer[:position] + choices[int(rng.integers(len(choices)))] + answer[position + 1 :]
