"""The cabinet rows: a pure function of the seed, held-out tasks none of the train tasks, and
demonstrations whose observations are exactly what the environment answers, ending in a rewarded
answer; `rldock data generate cabinet` writes them as files the loader reads."""

import asyncio
import json

import pytest

from rldock.config.data import DataSpec
from rldock.runtime.agent.examples.cabinet import Cabinet, build_cabinet
from rldock.runtime.agent.examples.cabinet_tasks import generate_cabinet
from rldock.runtime.agent.interfaces import EpisodeContext, Observation
from rldock.runtime.cli import main
from rldock.runtime.data import columns_of, load_rows


def test_rows_are_a_pure_function_of_the_seed():
    assert generate_cabinet(num_train=20, num_val=5, seed=0) == generate_cabinet(num_train=20, num_val=5, seed=0)
    assert generate_cabinet(num_train=20, num_val=5, seed=0) != generate_cabinet(num_train=20, num_val=5, seed=1)


def test_held_out_tasks_are_none_of_the_train_tasks():
    rows = generate_cabinet(num_train=300, num_val=50, seed=0)
    train = {row["extra_info"]["task_seed"] for row in rows.train}
    val = {row["extra_info"]["task_seed"] for row in rows.val}
    assert len(train) == 300 and len(val) == 50 and not train & val


@pytest.mark.parametrize("num_files, num_lines", [(4, 3), (2, 5)])
def test_a_row_is_its_task_and_its_demonstration_replays_through_the_environment(num_files, num_lines):
    for row in generate_cabinet(num_train=10, num_val=2, seed=3, num_files=num_files, num_lines=num_lines).train:
        extra = row["extra_info"]
        assert extra == {"task_seed": extra["task_seed"], "num_files": num_files, "num_lines": num_lines}
        task = build_cabinet(extra["task_seed"], num_files=num_files, num_lines=num_lines)
        assert (row["prompt"], row["answer"], row["data_source"]) == (task.prompt, task.answer, "cabinet")
        demonstration = row["demonstration"]
        assert [m["role"] for m in demonstration] == ["assistant", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in demonstration[::2]] == ["ls", f"cat {task.file}", f"#### {task.answer}"]
        session = Cabinet().session()
        context = EpisodeContext(ground_truth=row["answer"], data_source=row["data_source"], extra_info=extra)
        assert asyncio.run(session.reset(seed=0, episode_id="e", context=context)) == Observation()
        for turn, observed in zip(demonstration[::2], [*demonstration[1::2], None]):
            observation = asyncio.run(session.step(turn["content"]))
            if observed is None:
                assert observation == Observation(reward=1.0, done=True)
            else:
                assert observation == Observation(message=observed["content"])


def test_cli_writes_files_the_loader_reads_with_the_keys_it_prints(tmp_path, capsys):
    flags = ["--num-train", "6", "--num-val", "2", "--seed", "4", "--num-files", "3", "--num-lines", "2"]
    assert main(["data", "generate", "cabinet", *flags, "--output", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "train": [str(tmp_path / "train.jsonl")],
        "val": [str(tmp_path / "val.jsonl")],
        "prompt_key": "prompt",
        "answer_key": "answer",
        "demonstration_key": "demonstration",
        "extra_info_key": "extra_info",
    }
    spec = DataSpec(
        train_files=report["train"],
        val_files=report["val"],
        data_source_key="data_source",  # as the example config reads it
        **{key: value for key, value in report.items() if key.endswith("_key")},
    )
    rows = load_rows(report["train"], columns_of(spec))
    expected = generate_cabinet(num_train=6, num_val=2, seed=4, num_files=3, num_lines=2).train
    assert [(r.prompt, r.ground_truth, r.data_source) for r in rows] == [
        (e["prompt"], e["answer"], "cabinet") for e in expected
    ]
    assert [r.extra_info for r in rows] == [e["extra_info"] for e in expected]
    assert [r.demonstration for r in rows] == [e["demonstration"] for e in expected]
    assert len((tmp_path / "val.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--tool-demonstrations", "python"], "error: --tool-demonstrations: the cabinet rows always show"),
        (["--max-number", "5"], "error: --max-number: not read by the cabinet generator"),
        (["--num-files", "9"], "error: --num-files, --num-lines: a cabinet has 1 to 8 files"),
        (["--num-lines", "0"], "got 4 files of 0 lines"),
        (["--num-train", "0"], "error: --num-train: too few rows (got 0)"),
        (["--num-val", "-1"], "error: --num-val: too few rows (got -1)"),
    ],
)
def test_cli_refuses_what_the_cabinet_cannot_make_naming_the_flag(tmp_path, capsys, flags, says):
    assert main(["data", "generate", "cabinet", *flags, "--output", str(tmp_path)]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "train.jsonl").exists()
