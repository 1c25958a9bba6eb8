"""Reads the data files (jsonl, json, parquet) into checked `Row`s.

Files are read one by one with Hugging Face `datasets` (`load_dataset("json" | "parquet",
data_files=<one local path>)`, never the Hub), so each row's file is known: every error names the
file, the row and the column, and the default data source is the file's stem. Rows of several
files are concatenated in the order the config lists them; a row's place in that concatenation is
its `prompt_index`, which the dock carries beside the row itself (`prompt_row`, data/row_column.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from rldock.config.data import DataSpec
from rldock.runtime.data.demonstrations import check_demonstration
from rldock.runtime.data.generators import column_names
from rldock.runtime.data.keys import MissingKey, read_key
from rldock.runtime.data.rows import Row

logger = logging.getLogger(__name__)

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # suffix -> datasets builder


@dataclass(frozen=True)
class Columns:
    """The columns a job reads; None: not read. `pairs_required`: a missing chosen/rejected column
    is an error (set in the config) rather than a row without a pair (a generator's files).
    `demonstration`, when read, is in every row."""

    prompt: str
    answer: str
    data_source: str | None = None  # None: the file's stem
    extra_info: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    pairs_required: bool = False
    demonstration: str | None = None


def columns_of(spec: DataSpec) -> Columns:
    """What to read for `spec`: its keys, and for generated files the generator's own columns."""
    if spec.generator is not None:
        names = column_names(spec)
        return Columns(
            prompt=spec.prompt_key,
            answer=spec.answer_key,
            data_source=names["data_source"],
            extra_info=spec.extra_info_key,
            chosen=names["chosen"],
            rejected=names["rejected"],
            demonstration=names["demonstration"] if spec.generator.tool_demonstrations else None,
        )
    return Columns(
        prompt=spec.prompt_key,
        answer=spec.answer_key,
        data_source=spec.data_source_key,
        extra_info=spec.extra_info_key,
        chosen=spec.chosen_key,
        rejected=spec.rejected_key,
        pairs_required=spec.chosen_key is not None,
        demonstration=spec.demonstration_key,
    )


def val_columns(spec: DataSpec) -> Columns:
    """What to read of the validation files: the train files' columns but the demonstrations, which only
    the warm-up reads (on the train rows), so held-out files need not carry them."""
    return replace(columns_of(spec), demonstration=None)


def load_rows(files: Sequence[str | Path], columns: Columns, *, field: str = "data.train_files") -> list[Row]:
    """Every row of `files` in order, checked; `field` (the config field listing the files) is
    named in errors about a file as a whole."""
    if not files:
        raise ValueError(f"{field} is empty: list at least one .jsonl, .json or .parquet file")
    rows: list[Row] = []
    for name in files:
        rows.extend(_file_rows(Path(name), columns, field=field))
    return rows


def _file_rows(path: Path, columns: Columns, *, field: str) -> list[Row]:
    import datasets  # heavy (pyarrow, pandas): only where files are read

    builder = BUILDERS.get(path.suffix)
    if builder is None:
        raise ValueError(f"{field}: {path} has suffix {path.suffix!r}; use one of {sorted(BUILDERS)}")
    if not path.is_file():
        raise ValueError(f"{field}: {path} does not exist (is the volume holding it mounted?)")
    if path.stat().st_size == 0:
        raise ValueError(f"{field}: {path} is empty; it must hold at least one row")
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(builder, data_files=[str(path.resolve())], split="train")
    except datasets.exceptions.DatasetGenerationError as error:
        raise ValueError(f"{field}: {path} could not be read as {builder}: {error.__cause__ or error}") from error
    except ValueError as error:  # datasets' "corresponds to no data": a file without rows, e.g. "[]"
        raise ValueError(f"{field}: {path} holds no rows ({error})") from error
    if len(table) == 0:
        raise ValueError(f"{field}: {path} holds no rows")
    wanted = [columns.prompt, columns.answer, columns.data_source, columns.extra_info, columns.demonstration]
    if columns.pairs_required:
        wanted += [columns.chosen, columns.rejected]
    records = table.to_list()
    for key in wanted:
        if key is not None:
            try:
                read_key(records[0], key)
            except MissingKey as error:
                raise ValueError(f"{path}: {error} (the data section's key for it)") from error
    has_pairs = all(_has_key(records[0], key) for key in (columns.chosen, columns.rejected))
    return [_row(record, path, line, columns, has_pairs) for line, record in enumerate(records)]


def _has_key(record: dict, key: str | None) -> bool:
    if key is None:
        return False
    try:
        read_key(record, key)
    except MissingKey:
        return False
    return True


def _value(record: dict, key: str, where: str):
    """`read_key` with the row named: a key present in the first row may be missing in a later one
    (jsonl objects need not share their fields)."""
    try:
        return read_key(record, key)
    except MissingKey as error:
        raise ValueError(f"{where}: {error}") from error


def _row(record: dict, path: Path, line: int, columns: Columns, has_pairs: bool) -> Row:
    where = f"{path} row {line}"
    prompt = _value(record, columns.prompt, where)
    check_prompt(prompt, where=f"{where} column {columns.prompt!r}")
    extra = {} if columns.extra_info is None else _value(record, columns.extra_info, where)
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(
            f"{where} column {columns.extra_info!r} (data.extra_info_key) must be a dict, got {type(extra).__name__}"
        )
    source = path.stem if columns.data_source is None else _text(record, columns.data_source, where)
    chosen = rejected = None
    if has_pairs:
        # has_pairs: both columns are named and were found in the first record.
        assert columns.chosen is not None and columns.rejected is not None
        chosen = _text(record, columns.chosen, where)
        rejected = _text(record, columns.rejected, where)
    demonstration = None
    if columns.demonstration is not None:
        demonstration = check_demonstration(
            _value(record, columns.demonstration, where),
            where=f"{where} column {columns.demonstration!r} (data.demonstration_key)",
        )
    return Row(
        prompt=prompt,
        ground_truth=_text(record, columns.answer, where),
        data_source=source,
        extra_info=extra,
        chosen=chosen,
        rejected=rejected,
        demonstration=demonstration,
        file=str(path),
        line=line,
        columns={name: value for name, value in record.items() if name != columns.prompt},
    )


def _text(record: dict, key: str, where: str) -> str:
    """A string or number column as text; null, empty and other types are errors."""
    value = _value(record, key, where)
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"{where} column {key!r} must be a string or a number, got "
            f"{'null' if value is None else type(value).__name__}"
        )
    text = str(value)
    if not text.strip():
        raise ValueError(f"{where} column {key!r} is empty")
    return text


def check_prompt(prompt: object, *, where: str) -> None:
    """A prompt is a non-empty string or a non-empty list of {role, content} string messages."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: the prompt is empty")
        return
    if (
        isinstance(prompt, list)
        and prompt
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
        )
    ):
        return
    raise ValueError(
        f"{where}: a prompt must be a string or a non-empty list of chat messages "
        f"{{role, content}} (strings), got {prompt!r:.200}"
    )
