"""Checks a job's data files before anything starts: each opens, holds a row, that row has every
key the data section names (read with the loader's own key resolution, dotted keys included), and
its prompt can be rendered with data.chat_template (the loader's own check).

Only the first row is read (parquet: one row group's first batch; jsonl: the first line), so a
check of a large file costs milliseconds; a later row that lacks a key is still an error of the
full load (data/files.py), naming its row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rldock.config import DataSpec, Problem
from rldock.runtime.data.files import BUILDERS, columns_of, val_columns
from rldock.runtime.data.keys import MissingKey, read_key
from rldock.runtime.data.rendering import chat_template_problem

# Each key the loader reads, as (the Columns attribute, the data section's field naming it).
KEY_FIELDS = (
    ("prompt", "data.prompt_key"),
    ("answer", "data.answer_key"),
    ("data_source", "data.data_source_key"),
    ("extra_info", "data.extra_info_key"),
    ("chosen", "data.chosen_key"),
    ("rejected", "data.rejected_key"),
    ("demonstration", "data.demonstration_key"),
)


class UnreadableFile(ValueError):
    """The file does not open as its suffix says, or holds no row; the message says which."""


def first_row(path: Path) -> dict[str, Any]:
    """The first row of a `.jsonl`, `.json` or `.parquet` file, as the loader would read it."""
    if path.suffix not in BUILDERS:
        raise UnreadableFile(f"has suffix {path.suffix!r}; use one of {sorted(BUILDERS)}")
    if path.suffix == ".parquet":
        return _first_parquet_row(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        # datasets' json builder takes a JSON array of objects (or an object of columns) as well as
        # JSON lines in a .json file.
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            return _first_json_line(text)
        return _first_of_document(whole)
    return _first_json_line(text)


def _first_parquet_row(path: Path) -> dict[str, Any]:
    import pyarrow  # heavy: only where a parquet file is checked
    import pyarrow.parquet

    try:
        reader = pyarrow.parquet.ParquetFile(path)
        batch = next(reader.iter_batches(batch_size=1), None)
    except pyarrow.ArrowException as error:
        raise UnreadableFile(f"is not a readable parquet file: {error}") from error
    if batch is None or batch.num_rows == 0:
        raise UnreadableFile("holds no rows")
    return batch.to_pylist()[0]


def _first_json_line(text: str) -> dict[str, Any]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise UnreadableFile(
                f"line {number} is not JSON ({error.msg}); each line must be one JSON object"
            ) from error
        if not isinstance(record, dict):
            raise UnreadableFile(f"line {number} is a JSON {type(record).__name__}, not an object of columns")
        return record
    raise UnreadableFile("holds no rows")


def _first_of_document(whole: Any) -> dict[str, Any]:
    if isinstance(whole, list):
        if not whole:
            raise UnreadableFile("holds no rows (an empty JSON array)")
        if not isinstance(whole[0], dict):
            raise UnreadableFile(f"is a JSON array of {type(whole[0]).__name__}, not of objects (one per row)")
        return whole[0]
    if isinstance(whole, dict) and whole and all(isinstance(column, list) for column in whole.values()):
        if not all(whole.values()):
            raise UnreadableFile("holds no rows (empty columns)")
        return {name: column[0] for name, column in whole.items()}
    if isinstance(whole, dict):
        return whole  # one JSON object is one row
    raise UnreadableFile(f"is a JSON {type(whole).__name__}, not rows: use an array of objects or JSON lines")


def data_file_problems(spec: DataSpec) -> list[Problem]:
    """Every configured data file opens and its first row has each key the data section reads.
    Generated files are written by the job itself, so a generator's section has none to check.
    Run after the path checks (preflight), so each file exists."""
    if spec.generator is not None:
        return []
    problems = []
    for list_field, files, columns in (
        ("data.train_files", spec.train_files, columns_of(spec)),
        ("data.val_files", spec.val_files, val_columns(spec)),
    ):
        wanted = [(getattr(columns, name), field) for name, field in KEY_FIELDS if getattr(columns, name) is not None]
        for index, name in enumerate(files):
            problems.extend(_file_problems(Path(name), f"{list_field}[{index}]", wanted, spec))
    return problems


def _file_problems(path: Path, file_field: str, wanted: list[tuple[str, str]], spec: DataSpec) -> list[Problem]:
    try:
        row = first_row(path)
    except UnreadableFile as error:
        return [Problem(file_field, f"{path} {error}")]
    except OSError as error:
        return [Problem(file_field, f"{path} could not be read: {error.strerror}")]
    problems = []
    if _key_problem(row, spec.prompt_key) is None:
        template = chat_template_problem(read_key(row, spec.prompt_key), spec.chat_template)
        if template is not None:
            problems.append(
                Problem(
                    "data.chat_template",
                    f"data.prompt_key {spec.prompt_key!r} holds chat messages in {path} ({file_field}): {template}",
                )
            )
    for key, key_field in wanted:
        problem = _key_problem(row, key)
        if problem is not None:
            problems.append(
                Problem(
                    key_field,
                    f"{problem} in {path} ({file_field}); set {key_field} to the "
                    "column that holds it (a dotted key reads a nested field, e.g. "
                    "reward_model.ground_truth)",
                )
            )
    return problems


def _key_problem(row: dict[str, Any], key: str) -> str | None:
    try:
        read_key(row, key)
    except MissingKey as error:
        return str(error)
    return None
