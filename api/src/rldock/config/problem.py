"""A problem with a job config: the field's dotted path and what to do, as `rldock validate` prints it and the
operator puts it in a condition. Each config section's checks return these (rldock.config.problems gathers
them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    path: str  # dotted field path, e.g. "training.data_parallel_size"
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def field_path(parts: Iterable[str | int]) -> str:
    """A pydantic error location as a field path: ("reward", "terms", 1, "url") -> reward.terms[1].url."""
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path
