"""The built-in generators: deterministic from the seed, the addition rows the former task drew,
word problems in GSM8K's format with disjoint train/val questions, written as files the loader
reads with the config's keys (and by `rldock data generate`)."""

import json
import re

import numpy as np
import pytest

from rldock.config.data import DataSpec, GeneratorSpec
from rldock.runtime.cli import main
from rldock.runtime.data import columns_of, load_rows, prepare_data_files
from rldock.runtime.data.addition import generate_addition, wrong_answer
from rldock.runtime.data.word_problems import generate_word_problems

GSM8K_ANSWER = re.compile(r"^[^\n]+\n#### (\d+)$")


class ScriptedRng:
    """Test double for np.random.Generator: `integers` returns the scripted values in order."""

    def __init__(self, *values):
        self.values = list(values)

    def integers(self, high):
        value = self.values.pop(0)
        assert 0 <= value < high
        return value


def test_addition_rows_are_the_sums_the_former_task_drew_from_the_same_seed():
    rows = generate_addition(GeneratorSpec(name="addition", max_operand=12, num_prompts=200), seed=3).train
    operands = np.random.default_rng(3).integers(0, 13, size=(200, 2))  # the former AdditionTask's draw
    assert [r["prompt"] for r in rows] == [f"{a}+{b}=" for a, b in operands.tolist()]
    assert all(
        r["answer"] == str(a + b) and r["data_source"] == "addition" for r, (a, b) in zip(rows, operands.tolist())
    )


def test_addition_pairs_are_correct_versus_wrong_same_length_and_deterministic():
    spec = GeneratorSpec(name="addition", max_operand=99, num_prompts=300)
    rows = generate_addition(spec, seed=4).train
    for row in rows:
        assert row["chosen"] == row["answer"] and row["rejected"] != row["chosen"]
        assert len(row["rejected"]) == len(row["chosen"]) and row["rejected"].isdigit()
    assert generate_addition(spec, seed=4) == generate_addition(spec, seed=4)
    assert [r["rejected"] for r in generate_addition(spec, seed=5).train] != [r["rejected"] for r in rows]


def test_wrong_answer_replaces_one_digit():
    assert wrong_answer("95", ScriptedRng(1, 3)) == "93"  # position 1: digits without 5, index 3
    assert wrong_answer("95", ScriptedRng(0, 0)) == "15"  # a leading digit never becomes 0
    assert wrong_answer("7", ScriptedRng(0, 0)) == "0"


def test_word_problems_are_gsm8k_rows_whose_final_answer_matches_the_worked_solution():
    rows = generate_word_problems(GeneratorSpec(name="word_problems", num_prompts=300), seed=0).train
    kinds = set()
    for row in rows:
        match = GSM8K_ANSWER.match(row["answer"])
        assert match, row
        equation = re.search(r"(\d+) ([-+*/]) (\d+) = (\d+)", row["answer"])
        a, op, b, result = equation.groups()
        kinds.add(op)
        assert eval(f"{a} {op} {b}") == int(result) == int(match.group(1))  # noqa: S307 - digits and one operator
        assert row["prompt"].endswith("?") and row["data_source"] == "word_problems"
    assert kinds == {"+", "-", "*", "/"}


def test_word_problems_are_deterministic_and_val_questions_never_appear_in_train():
    spec = GeneratorSpec(name="word_problems", num_prompts=2000, num_val_prompts=300)
    first, again = generate_word_problems(spec, seed=7), generate_word_problems(spec, seed=7)
    assert first == again
    assert len(first.train) == 2000 and len(first.val) == 300
    val_questions = [r["prompt"] for r in first.val]
    assert len(set(val_questions)) == 300
    assert not set(val_questions) & {r["prompt"] for r in first.train}
    assert generate_word_problems(spec, seed=8).train != first.train


def test_word_problem_difficulty_knob_limits_the_kinds_and_numbers():
    spec = GeneratorSpec(
        name="word_problems", num_prompts=400, num_val_prompts=50, operations=["add", "subtract"], max_number=9
    )
    rows = generate_word_problems(spec, seed=0)
    kinds, numbers = set(), set()
    for row in [*rows.train, *rows.val]:
        a, op, b = re.search(r"(\d+) ([-+*/]) (\d+) =", row["answer"]).groups()
        kinds.add(op)
        numbers |= {int(a), int(b)}
    assert kinds == {"+", "-"} and max(numbers) == 9 and min(numbers) == 1
    products = generate_word_problems(
        GeneratorSpec(name="word_problems", num_prompts=200, operations=["multiply"], max_number=4), seed=0
    ).train
    assert {int(n) for r in products for n in re.findall(r"(\d+) \* (\d+)", r["answer"])[0]} == {2, 3, 4}


def test_too_narrow_word_problems_for_the_validation_size_name_the_knobs():
    spec = GeneratorSpec(
        name="word_problems", num_prompts=5000, num_val_prompts=5000, operations=["multiply"], max_number=3
    )
    with pytest.raises(ValueError, match="num_val_prompts.*operations or max_number"):
        generate_word_problems(spec, seed=0)


def test_a_generator_writes_files_under_the_configs_keys_and_the_loader_reads_them(tmp_path):
    spec = DataSpec(
        generator=GeneratorSpec(name="word_problems", num_prompts=20, num_val_prompts=5),
        prompt_key="question",
        chat_template="none",
    )
    files = prepare_data_files(spec, tmp_path, seed=0)
    assert files.train == [str(tmp_path / "data" / "train.jsonl")] and files.val == [
        str(tmp_path / "data" / "val.jsonl")
    ]
    first = json.loads((tmp_path / "data" / "train.jsonl").read_text().splitlines()[0])
    assert set(first) == {"question", "answer", "data_source"}
    rows = load_rows(files.train, columns_of(spec))
    assert len(rows) == 20 and rows[0].data_source == "word_problems" and "####" in rows[0].ground_truth
    assert not list((tmp_path / "data").glob(".*partial*"))  # written atomically, nothing left behind


def test_files_are_passed_through_when_no_generator_is_set(tmp_path):
    spec = DataSpec(train_files=["/data/a.jsonl"], val_files=["/data/b.parquet"])
    files = prepare_data_files(spec, tmp_path, seed=0)
    assert (files.train, files.val) == (["/data/a.jsonl"], ["/data/b.parquet"])
    assert not (tmp_path / "data").exists()


def test_cli_writes_gsm8k_files(tmp_path, capsys):
    assert (
        main(["data", "generate", "word_problems", "--num-train", "8", "--num-val", "2", "--out", str(tmp_path)]) == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_key"] == "question"
    train = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    assert len(train) == 8 and len(val) == 2 and set(train[0]) == {"question", "answer", "data_source"}
    assert main(["data", "generate", "addition", "--num-train", "0", "--out", str(tmp_path / "x")]) == 2
    assert (
        main(
            [
                "data",
                "generate",
                "word_problems",
                "--num-train",
                "4",
                "--operations",
                "add",
                "--max-number",
                "5",
                "--out",
                str(tmp_path / "easy"),
            ]
        )
        == 0
    )
    easy = [json.loads(line) for line in (tmp_path / "easy" / "train.jsonl").read_text().splitlines()]
    assert all(" + " in row["answer"] and int(row["answer"].split("#### ")[1]) <= 10 for row in easy)
    assert (
        main(
            [
                "data",
                "generate",
                "word_problems",
                "--num-train",
                "4",
                "--operations",
                "divide",
                "--out",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )


def test_cli_writes_three_digit_products_with_python_demonstrations(tmp_path, capsys):
    flags = [
        "--operations",
        "multiply",
        "--max-number",
        "999",
        "--max-factor",
        "999",
        "--tool-demonstrations",
        "python",
    ]
    assert main(["data", "generate", "word_problems", "--num-train", "20", *flags, "--out", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out)["demonstration_key"] == "demonstration"
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert set(rows[0]) == {"question", "answer", "data_source", "demonstration"}
    assert max(int(n) for row in rows for n in re.search(r"(\d+) \* (\d+)", row["answer"]).groups()) > 99
    assert all('"name": "python"' in row["demonstration"][0]["content"] for row in rows)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--num-train", "0"], "error: --num-train: Input should be greater than or equal to 1 (got 0)"),
        (["--num-val", "-1"], "error: --num-val: "),
        (["--operations", "add,divide"], "error: --operations: "),
        (["--max-number", "0"], "error: --max-number: "),
        (["--max-factor", "1"], "error: --max-factor: "),
    ],
)
def test_cli_errors_name_the_flag_not_the_config_field(tmp_path, capsys, flags, says):
    assert main(["data", "generate", "word_problems", *flags, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert says in err
    assert "num_prompts" not in err and "num_val_prompts" not in err and "validation error" not in err


@pytest.mark.parametrize(
    "generator, flags, named",
    [
        ("addition", ["--max-number", "3"], "--max-number"),
        ("addition", ["--operations", "add"], "--operations"),
        ("word_problems", ["--max-operand", "9"], "--max-operand"),
        ("addition", ["--max-factor", "9"], "--max-factor"),
    ],
)
def test_cli_refuses_the_other_generators_flag_instead_of_ignoring_it(tmp_path, capsys, generator, flags, named):
    assert main(["data", "generate", generator, *flags, "--out", str(tmp_path)]) == 2
    assert f"error: {named}: not read by the {generator} generator" in capsys.readouterr().err
    assert not (tmp_path / "train.jsonl").exists()


def test_cli_regenerating_into_a_used_folder_replaces_the_files_it_owns(tmp_path, capsys):
    assert main(["data", "generate", "addition", "--num-train", "6", "--num-val", "3", "--out", str(tmp_path)]) == 0
    (tmp_path / "notes.txt").write_text("mine")  # not the generator's: left alone
    assert main(["data", "generate", "addition", "--num-train", "4", "--out", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["val"] == []
    assert sorted(path.name for path in tmp_path.iterdir()) == ["notes.txt", "train.jsonl"]
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 4
