"""Preflight of the data section: every data file exists (PathNotFound, naming the list field and
index), opens and has the keys the data section names (InvalidJobInput, naming the key's field),
before Ray starts; `rldock validate` and `rldock train` report them the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow
import pyarrow.parquet
import pytest
import yaml

from rldock.config import parse_job_config
from rldock.contract.failure import FailureReason, last_failure
from rldock.runtime.cli import main
from rldock.runtime.data.probe import UnreadableFile, data_file_problems, first_row
from rldock.runtime.preflight import preflight

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml"
ROWS = [{"question": "What is 2 + 3?", "answer": "#### 5"}, {"question": "What is 1 + 1?", "answer": "#### 2"}]


def _job(tmp_path: Path, **data) -> dict:
    """The demo job (its model is built, so only the data is in question) reading files."""
    job = yaml.safe_load(EXAMPLE.read_text())
    job["model"]["path"] = str(tmp_path / "model")
    job["data"] = {"prompt_key": "question", "answer_key": "answer", "chat_template": "none", **data}
    if data.get("val_files"):
        job["evaluation"] = {"interval": 5}  # held-out files are read only with evaluation on
    return job


def _jsonl(path: Path, rows=ROWS) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _parquet(path: Path, rows) -> str:
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return str(path)


def test_files_with_the_keys_pass(tmp_path):
    cfg = parse_job_config(
        _job(
            tmp_path,
            train_files=[_jsonl(tmp_path / "train.jsonl")],
            val_files=[_parquet(tmp_path / "val.parquet", ROWS)],
        )
    )
    assert preflight(cfg) is None


def test_a_missing_data_file_is_path_not_found_naming_the_list_field(tmp_path):
    cfg = parse_job_config(
        _job(
            tmp_path,
            train_files=[_jsonl(tmp_path / "train.jsonl"), "/nonexistent/train.parquet"],
            val_files=[str(tmp_path / "val.jsonl")],
        )
    )
    failure = preflight(cfg)
    assert failure is not None and failure.reason is FailureReason.PATH_NOT_FOUND
    assert [p.field for p in failure.problems] == ["data.train_files[1]", "data.val_files[0]"]
    assert failure.problems[0].message.startswith("/nonexistent/train.parquet does not exist")


def test_a_generators_files_are_not_looked_for(tmp_path):
    job = _job(tmp_path, generator={"name": "addition"}, prompt_key="prompt")
    assert preflight(parse_job_config(job)) is None


def test_a_missing_key_names_the_key_field_the_file_and_what_it_holds(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"question": "q", "solution": "#### 1"}])
    failure = preflight(parse_job_config(_job(tmp_path, train_files=[train])))
    assert failure is not None and failure.reason is FailureReason.INVALID_JOB_INPUT
    (problem,) = failure.problems
    assert problem.field == "data.answer_key"
    assert "'answer'" in problem.message and "['question', 'solution']" in problem.message
    assert f"in {train} (data.train_files[0]); set data.answer_key" in problem.message


def test_a_dotted_key_reads_a_nested_parquet_column(tmp_path):
    """verl's layout: the answer under reward_model.ground_truth."""
    rows = [{"question": "q", "reward_model": {"style": "rule", "ground_truth": "7"}}]
    train = _parquet(tmp_path / "train.parquet", rows)
    assert (
        preflight(parse_job_config(_job(tmp_path, train_files=[train], answer_key="reward_model.ground_truth"))) is None
    )
    failure = preflight(parse_job_config(_job(tmp_path, train_files=[train], answer_key="reward_model.answer")))
    assert failure is not None and [p.field for p in failure.problems] == ["data.answer_key"]


def test_every_key_the_section_names_is_checked(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl")
    job = _job(tmp_path, train_files=[train], data_source_key="source", extra_info_key="meta")
    assert [p.path for p in data_file_problems(parse_job_config(job).data)] == [
        "data.data_source_key",
        "data.extra_info_key",
    ]


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("train.jsonl", "\n\n", "holds no rows"),
        ("train.jsonl", '{"question": "q", "answer": "1"\n', "line 1 is not JSON"),
        ("train.jsonl", '["q", "1"]\n', "line 1 is a JSON list, not an object of columns"),
        ("train.json", "[]", "holds no rows (an empty JSON array)"),
        ("train.parquet", "not parquet", "is not a readable parquet file"),
        ("train.csv", "question,answer\n", "has suffix '.csv'"),
    ],
)
def test_a_file_that_does_not_open_names_the_file_field(tmp_path, name, content, says):
    (tmp_path / name).write_text(content)
    cfg = parse_job_config(_job(tmp_path, train_files=[str(tmp_path / name)]))
    failure = preflight(cfg)
    assert failure is not None and failure.reason is FailureReason.INVALID_JOB_INPUT
    (problem,) = failure.problems
    assert problem.field == "data.train_files[0]" and says in problem.message


@pytest.mark.parametrize(
    "content",
    [
        json.dumps(ROWS),  # an array of objects
        json.dumps({"question": ["q1", "q2"], "answer": ["1", "2"]}),  # an object of columns
        "".join(json.dumps(row) + "\n" for row in ROWS),  # JSON lines in a .json file
    ],
)
def test_the_json_layouts_datasets_reads(tmp_path, content):
    path = tmp_path / "train.json"
    path.write_text(content)
    assert set(first_row(path)) == {"question", "answer"}


def test_an_empty_parquet_holds_no_rows(tmp_path):
    path = tmp_path / "train.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"question": pyarrow.array([], pyarrow.string())}), path)
    with pytest.raises(UnreadableFile, match="holds no rows"):
        first_row(path)


def _config_file(tmp_path: Path, **data) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(tmp_path, **data)))
    return str(path)


def test_validate_a_missing_train_file_exits_non_zero_naming_data_train_files(tmp_path, capsys):
    config = _config_file(tmp_path, train_files=["/nonexistent/train.parquet"])
    assert main(["validate", config]) == 2
    err = capsys.readouterr().err
    assert "data.train_files[0]: /nonexistent/train.parquet does not exist" in err
    assert main(["validate", config, "--no-path-checks"]) == 0  # a config meant for another machine


def test_an_rljobs_train_fails_at_once_with_path_not_found_for_a_data_file(tmp_path, capsys):
    """`--no-progress` is what the operator submits: the failure line makes the RLJob fail with
    reason PathNotFound naming the field, instead of a Ray job retried up to backoffLimit."""
    config = _config_file(tmp_path, train_files=["/nonexistent/train.parquet"])
    assert main(["train", config, "--output", str(tmp_path / "out"), "--no-progress"]) == 2
    failure = last_failure(capsys.readouterr().out.splitlines())
    assert failure is not None and failure.reason is FailureReason.PATH_NOT_FOUND
    assert [p.field for p in failure.problems] == ["data.train_files[0]"]
    assert not (tmp_path / "out").exists()


def _with_reward_file(tmp_path: Path, source: str, name: str = "score") -> dict:
    job = _job(tmp_path, train_files=[_jsonl(tmp_path / "train.jsonl")])
    (tmp_path / "my_reward.py").write_text(source)
    job["reward"] = {
        "terms": [{"name": "math_verify"}, {"name": "function", "function": f"{tmp_path}/my_reward.py:{name}"}]
    }
    return job


@pytest.mark.parametrize(
    "source",
    [
        "def score(data_source, solution_str, ground_truth, extra_info):\n    return 1.0\n",
        "from math import isclose as score\n",
        "score = lambda *args: 0.0\n",
        "try:\n    from fast import score\nexcept ImportError:\n    def score(*args):\n        return 0.0\n",
        "from helpers import *\n",  # may define it: left to the import where the job runs
    ],
)
def test_a_reward_file_that_defines_its_function_passes(tmp_path, source):
    assert preflight(parse_job_config(_with_reward_file(tmp_path, source))) is None


@pytest.mark.parametrize(
    "source, name, says",
    [
        (
            "def score(a, b, c, d):\n    return 1.0\n",
            "scor",
            "defines no 'scor' at its top level (its functions: ['score'])",
        ),
        ("def helper():\n    def score():\n        pass\n", "score", "defines no 'score'"),
        ("def score(:\n", "score", "line 1 is not valid Python"),
    ],
)
def test_a_reward_file_without_its_function_names_the_term(tmp_path, source, name, says):
    failure = preflight(parse_job_config(_with_reward_file(tmp_path, source, name)))
    assert failure is not None and failure.reason is FailureReason.INVALID_JOB_INPUT
    (problem,) = failure.problems
    assert problem.field == "reward.terms[1].function" and says in problem.message
