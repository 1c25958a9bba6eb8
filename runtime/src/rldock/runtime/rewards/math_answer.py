"""`math_verify`: 1.0 if the response's final answer equals the ground truth mathematically, else 0.0.

Equality is decided by Hugging Face's math-verify (`parse` to SymPy, then `verify`), so "42",
"42.0", "1,000" and "1000", "3/4" and `\\frac{3}{4}` compare as numbers and expressions, not strings.
Which part of a text is its final answer, for the ground truth and the response alike:

1. text after the last `####` (GSM8K's answer line), if there is one;
2. else a `\\boxed{...}` (the last one), if there is one;
3. else math-verify's own extraction: an "answer: X" / "final answer is X" phrase, else the last
   number or expression in the text.

A response without any answer scores 0. A ground truth without one is an error naming the
sample's data source and the ground-truth text (a data problem that `reward.on_error` decides on).

math-verify is imported on first use: with SymPy and its LaTeX parser it costs a process ~1.5 s of
CPU, and every process that imports the reward registry (the reward worker, the agent rollouts)
would pay it for jobs that never score with this term.
"""

from __future__ import annotations

import functools
import re
import threading

from rldock.config.reward import RewardTermSpec
from rldock.runtime.rewards.terms import BatchRewardFn, per_sample, register_reward

# What a text's answer is read as: \boxed{} first, then LaTeX and plain numbers/expressions (_ANSWER),
# or LaTeX alone (_LATEX); math-verify's configs for each from `_configs`.
_ANSWER, _LATEX = "answer", "latex"
# Seconds math-verify may spend on one parse or comparison (sympy can hang on adversarial text).
TIMEOUT_S = 5


def _timeout() -> int | None:
    # math-verify times out with signal.alarm, which works only in the main thread (where Ray runs
    # a synchronous actor's methods); elsewhere it would raise, so it runs without a limit.
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.cache
def _configs(kind: str) -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    latex = LatexExtractionConfig(boxed_match_priority=0)
    return (latex, ExprExtractionConfig()) if kind == _ANSWER else (latex,)


def _parse(text: str, kind: str) -> list:
    from math_verify import parse

    return parse(text, list(_configs(kind)), fallback_mode="no_fallback", parsing_timeout=_timeout())


# A word of two or more letters outside a LaTeX command: prose, which as LaTeX would parse as a
# product of symbols ("no" -> n*o).
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")


def _bare_expression(text: str) -> list:
    """A short answer such as `x+1`, which math-verify reads only as LaTeX between math delimiters."""
    text = text.strip()
    return _parse(f"${text}$", _LATEX) if text and not _PROSE.search(text) else []


def extract_answer(text: str) -> list:
    """The final answer of `text` parsed by math-verify (a list of SymPy objects; empty if none)."""
    if "####" in text:
        segment = text.rsplit("####", 1)[1]
        return _parse(segment, _ANSWER) or _bare_expression(segment)
    if "\\boxed" in text:
        boxed = _parse(text, _LATEX)
        if boxed:
            return boxed
    return _parse(text, _ANSWER)


@functools.lru_cache(maxsize=4096)
def _gold(ground_truth: str) -> tuple:
    # Each prompt's ground truth is parsed once per group of responses, not once per response.
    parsed = extract_answer(ground_truth)
    if not parsed and "####" not in ground_truth:
        parsed = _bare_expression(ground_truth)
    return tuple(parsed)


def math_verify_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> float:
    gold = _gold(ground_truth)
    if not gold:
        raise ValueError(
            f"math_verify cannot parse the ground truth {ground_truth[-200:]!r} of a sample "
            f"from data_source {data_source!r}: expected `#### <answer>`, `\\boxed{{...}}` "
            "or a number or expression"
        )
    answer = extract_answer(solution_str)
    if not answer:
        return 0.0
    from math_verify import verify

    return 1.0 if verify(list(gold), answer, timeout_seconds=_timeout()) else 0.0


@register_reward("math_verify")
def _build_math_verify(term: RewardTermSpec, at: str) -> BatchRewardFn:
    return per_sample(math_verify_reward)
