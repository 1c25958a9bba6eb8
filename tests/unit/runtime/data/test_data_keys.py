"""Data-section keys read nested columns: `reward_model.ground_truth` in verl's parquet layout."""

import pytest

from rldock.runtime.data import Columns, load_rows
from rldock.runtime.data.keys import MissingKey, read_key

VERL_ROW = {
    "data_source": "openai/gsm8k",
    "prompt": [{"role": "user", "content": "2+3?"}],
    "ability": "math",
    "reward_model": {"style": "rule", "ground_truth": "5"},
    "extra_info": {"split": "train", "index": 0},
}


def test_dotted_key_walks_nested_dicts_and_a_plain_key_reads_the_column():
    assert read_key(VERL_ROW, "reward_model.ground_truth") == "5"
    assert read_key(VERL_ROW, "extra_info") == {"split": "train", "index": 0}
    assert read_key(VERL_ROW, "extra_info.index") == 0


def test_a_column_named_with_the_dot_wins_over_the_walk():
    assert read_key({"a.b": 1, "a": {"b": 2}}, "a.b") == 1


@pytest.mark.parametrize(
    "key, message",
    [
        ("answer", r"no column 'answer': the row has no 'answer'; it has \['ability', 'data_source'"),
        ("reward_model.answer", r"'reward_model' has no 'answer'; it has \['ground_truth', 'style'\]"),
        ("ability.level", r"'ability' is a str, not a dict to read 'level' from"),
    ],
)
def test_a_missing_key_names_the_part_and_what_is_there(key, message):
    with pytest.raises(MissingKey, match=message):
        read_key(VERL_ROW, key)


def test_verl_parquet_loads_with_dotted_keys(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    second = dict(
        VERL_ROW, reward_model={"style": "rule", "ground_truth": "7"}, extra_info={"split": "train", "index": 1}
    )
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW, second]), path)
    rows = load_rows(
        [path],
        Columns(
            prompt="prompt", answer="reward_model.ground_truth", data_source="data_source", extra_info="extra_info"
        ),
    )
    assert [(r.ground_truth, r.data_source, r.extra_info["index"]) for r in rows] == [
        ("5", "openai/gsm8k", 0),
        ("7", "openai/gsm8k", 1),
    ]
    assert rows[0].prompt == VERL_ROW["prompt"]


def test_a_missing_nested_key_names_the_file_and_the_key(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW]), path)
    with pytest.raises(ValueError, match=r"train.parquet: no column 'reward_model.answer'.*has \['ground_truth'"):
        load_rows([path], Columns(prompt="prompt", answer="reward_model.answer"))
