"""Built-in data generators by name, and the files they write.

A generator's rows are written as jsonl under the column names the `data` section reads
(`prompt_key`, `answer_key`, ...), so generated data goes through exactly the loader user files go
through: `prepare_data_files` is the only place that knows whether the files were generated.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rldock.config.data import DataSpec, GeneratorSpec
from rldock.runtime.data.addition import generate_addition
from rldock.runtime.data.rows import GeneratedRows
from rldock.runtime.data.word_problems import generate_word_problems
from rldock.runtime.registry import Registry

DATA_DIR = "data"  # under the job's output directory
TRAIN_FILE, VAL_FILE = "train.jsonl", "val.jsonl"
# Columns a generator writes when the config names none for them (data_source_key etc. unset).
DEFAULT_COLUMNS = {
    "data_source": "data_source",
    "chosen": "chosen",
    "rejected": "rejected",
    "demonstration": "demonstration",
    "extra_info": "extra_info",
}

Generator = Callable[..., GeneratedRows]  # (GeneratorSpec, *, seed) -> GeneratedRows

GENERATORS: Registry[Generator] = Registry("data generator", field="data.generator.name")
GENERATORS.register("addition")(generate_addition)
GENERATORS.register("word_problems")(generate_word_problems)


@dataclass(frozen=True)
class DataFiles:
    """The files a job reads, after any generator wrote them."""

    train: list[str]
    val: list[str]


def column_names(spec: DataSpec) -> dict[str, str]:
    """Logical key (`prompt`, `answer`, `data_source`, `chosen`, `rejected`, `demonstration`, `extra_info`)
    -> the column generated files use: the config's key where it names one, else DEFAULT_COLUMNS."""
    return {
        "prompt": spec.prompt_key,
        "answer": spec.answer_key,
        "data_source": spec.data_source_key or DEFAULT_COLUMNS["data_source"],
        "chosen": spec.chosen_key or DEFAULT_COLUMNS["chosen"],
        "rejected": spec.rejected_key or DEFAULT_COLUMNS["rejected"],
        "demonstration": spec.demonstration_key or DEFAULT_COLUMNS["demonstration"],
        "extra_info": spec.extra_info_key or DEFAULT_COLUMNS["extra_info"],
    }


def write_jsonl(rows: Sequence[dict], path: Path, columns: dict[str, str]) -> Path:
    """`rows` (logical keys) as jsonl at `path` under `columns`, written atomically: a reader (a
    worker of a retried job) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    with tmp.open("w") as out:
        for row in rows:
            out.write(json.dumps({columns[key]: value for key, value in row.items()}) + "\n")
    os.replace(tmp, path)
    return path


def generate_files(spec: GeneratorSpec, out_dir: Path, *, seed: int, columns: dict[str, str]) -> DataFiles:
    """Run the generator and write its rows in `out_dir` (write_rows)."""
    return write_rows(GENERATORS.get(spec.name)(spec, seed=seed), out_dir, columns=columns)


def write_rows(rows: GeneratedRows, out_dir: Path, *, columns: dict[str, str]) -> DataFiles:
    """`rows` as `train.jsonl` (and `val.jsonl` when there are validation rows) in `out_dir`. Both names
    are the generator's own in `out_dir`: a `val.jsonl` an earlier run with validation rows left there
    is removed when this one makes none, so the folder holds this run's rows only."""
    train = write_jsonl(rows.train, out_dir / TRAIN_FILE, columns)
    if rows.val:
        val = [str(write_jsonl(rows.val, out_dir / VAL_FILE, columns))]
    else:
        (out_dir / VAL_FILE).unlink(missing_ok=True)
        val = []
    return DataFiles(train=[str(train)], val=val)


def prepare_data_files(spec: DataSpec, output_dir: Path, *, seed: int) -> DataFiles:
    """The job's train and validation files: `data.train_files`/`val_files`, or the generator's
    files in `<output_dir>/data/`, written again at every start (generation is deterministic and
    takes well under a second, so a resumed job reads the same rows)."""
    if spec.generator is None:
        return DataFiles(train=list(spec.train_files), val=list(spec.val_files))
    return generate_files(spec.generator, Path(output_dir) / DATA_DIR, seed=seed, columns=column_names(spec))
