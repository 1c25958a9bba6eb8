"""Loading data files (jsonl, json, parquet) into checked rows, and every bad input named by file,
row and column."""

import json

import pytest

from rldock.config.data import DataSpec, GeneratorSpec
from rldock.runtime.data import Columns, columns_of, load_rows

COLUMNS = Columns(prompt="prompt", answer="answer")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_jsonl_json_and_parquet_files_load_in_order_with_their_stem_as_data_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    first = _jsonl(tmp_path / "gsm.jsonl", [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": "4"}])
    second = tmp_path / "more.json"
    second.write_text(json.dumps([{"prompt": "3+3=", "answer": "6"}]))
    third = tmp_path / "table.parquet"
    pq.write_table(pa.table({"prompt": ["4+4="], "answer": ["8"]}), third)
    rows = load_rows([first, second, third], COLUMNS)
    assert [(r.prompt, r.ground_truth, r.data_source) for r in rows] == [
        ("1+1=", "2", "gsm"),
        ("2+2=", "4", "gsm"),
        ("3+3=", "6", "more"),
        ("4+4=", "8", "table"),
    ]
    assert (rows[1].file, rows[1].line) == (str(first), 1)
    assert rows[0].extra_info == {} and rows[0].chosen is None


def test_chat_message_prompts_data_source_and_extra_info_columns(tmp_path):
    messages = [{"role": "user", "content": "What is 2+3?"}]
    path = _jsonl(
        tmp_path / "chat.jsonl", [{"q": messages, "a": "5", "src": "math", "info": {"split": "train", "index": 0}}]
    )
    rows = load_rows([path], Columns(prompt="q", answer="a", data_source="src", extra_info="info"))
    assert rows[0].prompt == messages
    assert rows[0].data_source == "math"
    assert rows[0].extra_info == {"split": "train", "index": 0}


def test_preference_columns_are_read_when_configured(tmp_path):
    path = _jsonl(tmp_path / "pairs.jsonl", [{"prompt": "1+1=", "answer": "2", "good": "2", "bad": "3"}])
    columns = columns_of(DataSpec(train_files=[str(path)], chosen_key="good", rejected_key="bad"))
    row = load_rows([path], columns)[0]
    assert (row.chosen, row.rejected) == ("2", "3")


def test_generated_files_read_the_generators_own_columns():
    columns = columns_of(DataSpec(generator=GeneratorSpec(name="addition"), prompt_key="q"))
    assert (columns.prompt, columns.data_source, columns.chosen, columns.pairs_required) == (
        "q",
        "data_source",
        "chosen",
        False,
    )


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"does not exist"),
        ("", r"is empty"),
        ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n', r"could not be read as json"),
        ('{"question": "1+1=", "answer": "2"}\n', r"no column 'prompt'"),
        (
            '{"prompt": "a", "answer": "1"}\n{"prompt": 5, "answer": "2"}\n',
            r"row 1 column 'prompt'.*string or a non-empty list",
        ),
        ('{"prompt": [{"role": "user"}], "answer": "2"}\n', r"row 0 column 'prompt'.*chat messages"),
        ('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": null}\n', r"row 1 column 'answer'.*got null"),
        ('{"prompt": "a", "answer": "  "}\n', r"row 0 column 'answer' is empty"),
        ('{"prompt": "a", "answer": true}\n', r"row 0 column 'answer'.*got bool"),
    ],
)
def test_bad_input_names_the_file_row_and_column(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        load_rows([path], COLUMNS)
    assert str(path) in str(error.value)


def test_extra_info_must_be_a_dict(tmp_path):
    path = _jsonl(tmp_path / "x.jsonl", [{"prompt": "a", "answer": "1", "info": "text"}])
    with pytest.raises(ValueError, match=r"x.jsonl row 0 column 'info' \(data.extra_info_key\) must be a dict"):
        load_rows([path], Columns(prompt="prompt", answer="answer", extra_info="info"))


def test_a_file_without_rows_and_an_unknown_suffix_are_refused(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(ValueError, match=r"empty.json holds no rows"):
        load_rows([empty], COLUMNS)
    with pytest.raises(ValueError, match=r"data.val_files: .*data.csv has suffix '.csv'"):
        load_rows([tmp_path / "data.csv"], COLUMNS, field="data.val_files")
    with pytest.raises(ValueError, match=r"data.train_files is empty"):
        load_rows([], COLUMNS)
