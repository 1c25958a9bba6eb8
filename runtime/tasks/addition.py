"""The `addition` task: prompts like "37+58=" whose reference answer is "95".

Operands are drawn uniformly from 0..max_operand (with replacement, so small operand ranges repeat
prompts). The prompt ends with "=", so a model trained on prompt + answer + EOS learns to write
the sum right after the prompt and stop.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rldock.runtime.tasks.base import Example

ALPHABET = "0123456789+="


class AdditionTask:
    name = "addition"

    def __init__(self, *, max_operand: int, num_prompts: int, seed: int):
        if max_operand < 1:
            raise ValueError(f"task.max_operand must be >= 1, got {max_operand}")
        if num_prompts < 1:
            raise ValueError(f"task.num_prompts must be >= 1, got {num_prompts}")
        self.max_operand = max_operand
        rng = np.random.default_rng(seed)
        operands = rng.integers(0, max_operand + 1, size=(num_prompts, 2))  # (P, 2)
        self._operands = [(int(a), int(b)) for a, b in operands]

    def __len__(self) -> int:
        return len(self._operands)

    def __getitem__(self, index: int) -> Example:
        return self._example(*self._operands[index])

    def examples(self, indices: Sequence[int]) -> list[Example]:
        return [self[i] for i in indices]

    @staticmethod
    def _example(a: int, b: int) -> Example:
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))

    def corpus(self) -> list[str]:
        # The alphabet line guarantees every digit is in the vocabulary even when the operand
        # range is too small for the prompt set to contain all of them: a sampling model can
        # still emit any digit.
        return [ALPHABET] + [ex.prompt + ex.answer for ex in self.examples(range(len(self)))]
