"""Train rows through the dock (data/row_column.py): a row comes back from the `prompt_row` column exactly as
the driver loaded it, numpy values from a parquet file included, whatever the padding; and no worker-side
module reads the train files, which only the driver loads."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from rldock.runtime.data import Row
from rldock.runtime.data.row_column import padded_rows, row_bytes, rows_from_column

RUNTIME = Path(__file__).resolve().parents[4] / "runtime" / "src" / "rldock" / "runtime"


def column(rows: list[Row], width: int) -> torch.Tensor:
    return torch.frombuffer(padded_rows([row_bytes(r) for r in rows], width), dtype=torch.uint8).view(len(rows), width)


def test_rows_come_back_from_the_column_as_loaded_whatever_their_padding():
    rows = [
        Row("3+4=", "7", "addition", line=0),
        Row(
            [{"role": "user", "content": "¿2+2?"}],
            "4",
            "chat",
            {"level": np.int64(3), "ids": np.array([1, 2])},
            columns={"answer": 4, "tags": ["a", "b"]},
            file="train.parquet",
            line=1,
        ),
    ]
    width = max(len(row_bytes(r)) for r in rows)
    for padding in (0, 1, 100):
        back = rows_from_column(column([*rows, rows[0]], width + padding))
        assert back[0] == rows[0] and back[2] == rows[0]
        assert back[1].prompt == rows[1].prompt and back[1].columns == rows[1].columns
        assert back[1].extra_info["level"] == 3 and back[1].extra_info["ids"].tolist() == [1, 2]


def test_a_row_longer_than_the_column_is_refused():
    row = Row("3+4=", "7", "addition")
    with pytest.raises(ValueError, match="does not fit the dock's prompt_row column of 8"):
        padded_rows([row_bytes(row)], 8)


# What reading the train files looks like: the loader, its field, and the readers under it.
READS_FILES = {"load_rows", "train_files", "load_dataset", "read_parquet", "read_json"}
WORKER_SIDE = ["workers", "rollout", "agent", "gateway", "engines", "training", "rewards", "models", "dock"]


def _names(tree: ast.AST) -> set[str]:
    """Every name a module's code uses: variables, attributes, parameters, keywords and imported names."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.arg | ast.keyword) and node.arg is not None:
            names.add(node.arg)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("package", WORKER_SIDE)
def test_no_worker_side_module_reads_the_train_files(package):
    """Only the driver (and the CLI's commands) load rows: a worker gets each sample's row from the dock."""
    readers = {
        str(path.relative_to(RUNTIME)): sorted(_names(ast.parse(path.read_text())) & READS_FILES)
        for path in sorted((RUNTIME / package).rglob("*.py"))
    }
    assert {module: names for module, names in readers.items() if names} == {}


def test_the_scan_sees_a_train_file_read_in_each_form():
    code = "def f(train_files): pass\nload(files=x.train_files)\nfrom rldock.runtime.data import load_rows\n"
    assert _names(ast.parse(code)) & READS_FILES == {"train_files", "load_rows"}
    assert _names(ast.parse("g(data_files=p)\npandas.read_parquet(p)")) & READS_FILES == {"read_parquet"}
