"""The record types the data package passes around: a loaded row, a rendered example, a pair."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# A prompt as stored in a file: plain text, or chat messages [{"role": ..., "content": ...}].
RawPrompt = str | list


@dataclass(frozen=True)
class Row:
    """One row of a data file, checked and converted; `file` and `line` name it in errors."""

    prompt: RawPrompt
    ground_truth: str
    data_source: str
    extra_info: dict = field(default_factory=dict)
    chosen: str | None = None  # DPO: the preferred response (data.chosen_key)
    rejected: str | None = None  # DPO: the dispreferred response (data.rejected_key)
    # The chat messages that follow the prompt, solving it (data.demonstration_key): the warm-up's target.
    demonstration: list[dict] | None = None
    file: str = ""
    line: int = 0  # 0-based row in its file
    # Every top-level column of the row but the prompt's, as read: what a TRL-form reward function
    # gets as keyword lists (rewards/forms.py).
    columns: dict = field(default_factory=dict)


class Example(NamedTuple):
    prompt: str  # the model's input text after the chat template, e.g. "37+58="
    ground_truth: str  # reference answer the rewards compare with, e.g. "95"
    data_source: str  # e.g. "addition", or the file's stem
    extra_info: dict  # passed to reward functions
    prompt_index: int  # the row in the concatenated train files (the dock's `prompt_index`)


class PreferencePair(NamedTuple):
    prompt_index: int  # the row whose prompt both responses answer
    chosen: str  # the preferred response, e.g. the reference answer "95"
    rejected: str  # a dispreferred response, e.g. a wrong answer "85"


@dataclass(frozen=True)
class GeneratedRows:
    """What a generator makes: rows with the logical keys `prompt`, `answer`, `data_source` (and
    `chosen`/`rejected` where it makes preference pairs, `demonstration` where it shows the task
    solved with a tool), before they are written under the keys the config names."""

    train: list[dict]
    val: list[dict]
