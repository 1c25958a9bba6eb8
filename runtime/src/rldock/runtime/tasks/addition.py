"""The `addition` task: prompts like "37+58=" whose reference answer is "95".

Operands are drawn uniformly from 0..max_operand (with replacement, so small operand ranges repeat
prompts). The prompt ends with "=", so a model trained on prompt + answer + EOS learns to write
the sum right after the prompt and stop.

For preference training (DPO) each prompt also has a pair: chosen = the sum, rejected = the sum
with one digit replaced by another, so both have the same length and differ only in correctness
(a length difference would give the preference an easier, meaningless cue).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from rldock.runtime.tasks.base import Example, PreferencePair

ALPHABET = "0123456789+="


class AdditionTask:
    name = "addition"

    def __init__(self, *, max_operand: int, num_prompts: int, seed: int):
        if max_operand < 1:
            raise ValueError(f"task.max_operand must be >= 1, got {max_operand}")
        if num_prompts < 1:
            raise ValueError(f"task.num_prompts must be >= 1, got {num_prompts}")
        self.max_operand = max_operand
        self.seed = seed
        rng = np.random.default_rng(seed)
        operands = rng.integers(0, max_operand + 1, size=(num_prompts, 2))  # (P, 2)
        self._operands = [(int(a), int(b)) for a, b in operands]

    def __len__(self) -> int:
        return len(self._operands)

    def __getitem__(self, index: int) -> Example:
        return self._example(*self._operands[index])

    def examples(self, indices: Sequence[int]) -> list[Example]:
        return [self[i] for i in indices]

    def preference_pairs(self, indices: Sequence[int]) -> list[PreferencePair]:
        """(prompt, correct sum, wrong sum) for each index; the wrong sum depends only on (seed, index)."""
        pairs = []
        for i in indices:
            example = self[i]
            rng = np.random.default_rng([self.seed, int(i)])
            pairs.append(PreferencePair(example.prompt, example.answer, wrong_answer(example.answer, rng)))
        return pairs

    @staticmethod
    def _example(a: int, b: int) -> Example:
        return Example(prompt=f"{a}+{b}=", answer=str(a + b))

    def corpus(self) -> list[str]:
        # The alphabet line guarantees every digit is in the vocabulary even when the operand
        # range is too small for the prompt set to contain all of them: a sampling model can
        # still emit any digit.
        return [ALPHABET] + [ex.prompt + ex.answer for ex in self.examples(range(len(self)))]


def wrong_answer(answer: str, rng: np.random.Generator) -> str:
    """`answer` (digits) with one digit, picked by `rng`, replaced by a different digit; a leading
    digit of a multi-digit answer never becomes 0, so the result still reads as a number."""
    position = int(rng.integers(len(answer)))
    lowest = 1 if position == 0 and len(answer) > 1 else 0
    choices = [str(d) for d in range(lowest, 10) if str(d) != answer[position]]
    return answer[:position] + choices[int(rng.integers(len(choices)))] + answer[position + 1:]
