"""Reads a data-section key (`answer_key`, `data_source_key`, ...) out of one row, dotted keys included.

verl's preprocessed parquet (GSM8K, MATH, ...) nests the answer: `reward_model: {style,
ground_truth}`, `extra_info: {split, index, ...}`. A dotted key such as `reward_model.ground_truth`
walks into such struct (parquet) or object (jsonl) columns, so those files train as they are. A
top-level column whose own name holds the dot wins, so flat files with dotted column names (and
generated files, written under the configured key) read as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class MissingKey(ValueError):
    """`key` is not in the row; the message names the key and what the row holds where the walk stopped."""


def read_key(record: Mapping[str, Any], key: str) -> Any:
    """The value under `key` in `record`: the column named `key`, else for `a.b.c` the field
    `record["a"]["b"]["c"]` of nested dicts. Raises `MissingKey` naming the part not found."""
    if key in record:
        return record[key]
    value: Any = record
    walked: list[str] = []
    for part in key.split("."):
        if not isinstance(value, Mapping):
            raise MissingKey(
                f"no column {key!r}: {'.'.join(walked)!r} is a {type(value).__name__}, not a dict to read {part!r} from"
            )
        if part not in value:
            where = "the row" if not walked else f"{'.'.join(walked)!r}"
            raise MissingKey(f"no column {key!r}: {where} has no {part!r}; it has {sorted(value)}")
        value = value[part]
        walked.append(part)
    return value
