"""Tool-use demonstrations: the generators write the task solved with a tool (a Hermes call the parser
reads, the tool's reply, the answer in the task's format) under data.demonstration_key's column, and the
loader reads them into `Row.demonstration`, naming the file, row and column of a malformed one."""

import asyncio
import contextlib
import io
import json
import re

import pytest

from rldock.config.agent import SandboxSpec
from rldock.config.data import DataSpec, GeneratorSpec
from rldock.runtime.agent.interfaces import ToolResult
from rldock.runtime.chat.parsers import HermesParser
from rldock.runtime.data import Columns, columns_of, load_rows, prepare_data_files, val_columns
from rldock.runtime.data.addition import generate_addition
from rldock.runtime.data.demonstrations import tool_call_text, tool_demonstration
from rldock.runtime.data.probe import data_file_problems
from rldock.runtime.data.word_problems import generate_word_problems


def _stdout(code: str) -> str:
    """What the `python` tool returns for `code`: its stdout (the code is a generated print of digits)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})  # noqa: S102 - a generated `print(<digits> <op> <digits>)`
    return out.getvalue()


def test_a_python_demonstration_calls_the_tool_reads_its_stdout_and_answers():
    answer = "Sam has 123 * 456 = 56088 apples.\n#### 56088"
    assert tool_demonstration("python", "123 * 456", 56088, answer) == [
        {
            "role": "assistant",
            "content": '<tool_call>{"name": "python", "arguments": {"code": "print(123 * 456)"}}</tool_call>',
        },
        {"role": "tool", "content": "56088\n"},
        {"role": "assistant", "content": answer},
    ]


def test_a_calculator_demonstration_passes_the_expression_and_reads_the_value():
    call, reply, final = tool_demonstration("calculator", "37 + 58", 95, "95")
    assert call["content"] == '<tool_call>{"name": "calculator", "arguments": {"expression": "37 + 58"}}</tool_call>'
    assert (reply, final) == ({"role": "tool", "content": "95"}, {"role": "assistant", "content": "95"})


def test_the_hermes_parser_reads_the_demonstrated_call():
    (parsed,) = HermesParser().parse(tool_call_text("python", {"code": "print(1 + 2)"})).calls
    assert (parsed.name, dict(parsed.arguments)) == ("python", {"code": "print(1 + 2)"})


def test_addition_demonstrations_compute_the_sum_with_python():
    spec = GeneratorSpec(name="addition", num_prompts=50, num_val_prompts=5, tool_demonstrations="python")
    rows = generate_addition(spec, seed=0)
    for row in [*rows.train, *rows.val]:
        call, reply, final = row["demonstration"]
        (parsed,) = HermesParser().parse(call["content"]).calls
        a, b = row["prompt"].removesuffix("=").split("+")
        assert parsed.arguments == {"code": f"print({a} + {b})"}
        assert (
            reply
            == {"role": "tool", "content": _stdout(parsed.arguments["code"])}
            == {
                "role": "tool",
                "content": row["answer"] + "\n",
            }
        )
        assert final == {"role": "assistant", "content": row["answer"]}
    plain = generate_addition(GeneratorSpec(name="addition", num_prompts=50, num_val_prompts=5), seed=0)
    assert [{k: v for k, v in r.items() if k != "demonstration"} for r in rows.train] == plain.train
    assert "demonstration" not in plain.train[0]


def test_word_problems_with_three_digit_numbers_are_solved_with_the_tool_in_gsm8k_format():
    spec = GeneratorSpec(
        name="word_problems",
        num_prompts=300,
        max_number=999,
        max_factor=999,
        tool_demonstrations="python",
    )
    rows = generate_word_problems(spec, seed=0).train
    factors = set()
    for row in rows:
        call, reply, final = row["demonstration"]
        (parsed,) = HermesParser().parse(call["content"]).calls
        result = re.fullmatch(r"[^\n]+\n#### (\d+)", row["answer"]).group(1)
        assert reply["content"] == _stdout(parsed.arguments["code"]) == result + "\n"
        assert final == {"role": "assistant", "content": row["answer"]}
        if product := re.search(r"(\d+) \* (\d+) =", row["answer"]):
            factors |= {int(product.group(1)), int(product.group(2))}
    assert max(factors) > 900 and min(factors) < 100  # 3-digit factors drawn from 2..999


@pytest.mark.parametrize("tool", ["python", "calculator"])
def test_the_built_in_tool_replies_to_the_demonstrated_call_with_the_demonstrated_reply(tool):
    """One row of each kind, 3-digit numbers: the call runs on the real tool (the python sandbox)."""
    from rldock.runtime.agent.tools import CalculatorTool, PythonTool

    tools = {"python": PythonTool(SandboxSpec()), "calculator": CalculatorTool()}
    for operation in ("add", "subtract", "multiply", "share"):
        spec = GeneratorSpec(
            name="word_problems",
            num_prompts=1,
            operations=[operation],
            max_number=999,
            max_factor=999,
            tool_demonstrations=tool,
        )
        (row,) = generate_word_problems(spec, seed=0).train
        call, reply, _ = row["demonstration"]
        (parsed,) = HermesParser().parse(call["content"]).calls
        assert parsed.name == tool
        assert asyncio.run(tools[tool].call(parsed.arguments)) == ToolResult(reply["content"])
        assert reply["content"].strip() == row["answer"].split("#### ")[1]


def test_default_word_problems_are_unchanged():
    """The first rows of seed 0 with the defaults (factors up to 10, no demonstrations), pinned."""
    rows = generate_word_problems(GeneratorSpec(name="word_problems", num_prompts=3), seed=0).train
    assert [(r["prompt"], r["answer"]) for r in rows] == [
        (
            "Zoe shares 16 cookies equally among 4 friends. How many cookies does each friend get?",
            "Each friend gets 16 / 4 = 4 cookies.\n#### 4",
        ),
        (
            "Sam has 4 apples and buys 17 more. How many apples does Sam have now?",
            "Sam has 4 + 17 = 21 apples.\n#### 21",
        ),
        (
            "Ken has 7 boxes with 10 cookies in each box. How many cookies does Ken have in all?",
            "Ken has 7 * 10 = 70 cookies.\n#### 70",
        ),
    ]
    assert all(set(r) == {"prompt", "answer", "data_source"} for r in rows)


def test_max_factor_bounds_products_and_shares():
    spec = GeneratorSpec(name="word_problems", num_prompts=300, operations=["multiply"], max_number=999, max_factor=5)
    rows = generate_word_problems(spec, seed=0).train
    assert {int(n) for r in rows for n in re.search(r"(\d+) \* (\d+)", r["answer"]).groups()} == {2, 3, 4, 5}


@pytest.mark.parametrize("key, column", [(None, "demonstration"), ("solved", "solved")])
def test_generated_demonstrations_are_written_under_the_configs_key_and_loaded(tmp_path, key, column):
    spec = DataSpec(
        generator=GeneratorSpec(name="word_problems", num_prompts=8, num_val_prompts=2, tool_demonstrations="python"),
        demonstration_key=key,
    )
    files = prepare_data_files(spec, tmp_path, seed=0)
    written = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines()]
    assert set(written[0]) == {"prompt", "answer", "data_source", column}
    rows = load_rows(files.train, columns_of(spec))
    assert [row.demonstration for row in rows] == [r[column] for r in written]
    assert load_rows(files.val, columns_of(spec))[0].demonstration is not None


def test_generated_files_without_demonstrations_load_rows_without_them(tmp_path):
    spec = DataSpec(generator=GeneratorSpec(name="addition", num_prompts=4))
    rows = load_rows(prepare_data_files(spec, tmp_path, seed=0).train, columns_of(spec))
    assert columns_of(spec).demonstration is None and rows[0].demonstration is None


def test_a_files_demonstration_column_is_read_when_configured(tmp_path):
    demo = [
        {"role": "assistant", "content": "call"},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "3"},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "answer": "3", "demo": demo}) + "\n")
    columns = columns_of(DataSpec(train_files=[str(path)], demonstration_key="demo"))
    assert columns.demonstration == "demo"
    assert load_rows([path], columns)[0].demonstration == demo


GOOD = [{"role": "assistant", "content": "3"}]


@pytest.mark.parametrize(
    "value, message",
    [
        (None, r"row 1 column 'demo' \(data.demonstration_key\): a demonstration must be a non-empty list.*got null"),
        ([], r"row 1 column 'demo' .*non-empty list of chat messages, got \[\]"),
        ("3", r"row 1 column 'demo' .*non-empty list"),
        ([{"role": "assistant"}], r"row 1 column 'demo' .*message 0 must be an object with a string `content`"),
        ([{"role": "system", "content": "x"}, *GOOD], r"row 1 .*message 0 has role 'system'.*assistant, tool, user"),
        ([*GOOD, {"role": "tool", "content": "3"}], r"row 1 .*the last message is a 'tool' message"),
    ],
)
def test_a_malformed_demonstration_names_the_file_row_and_column(tmp_path, value, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        json.dumps({"prompt": "1+2=", "answer": "3", "demo": GOOD})
        + "\n"
        + json.dumps({"prompt": "1+2=", "answer": "3", "demo": value})
        + "\n"
    )
    with pytest.raises(ValueError, match=message) as error:
        load_rows([path], Columns(prompt="prompt", answer="answer", demonstration="demo"))
    assert str(path) in str(error.value)


def test_a_missing_demonstration_column_names_the_key(tmp_path):
    path = tmp_path / "none.jsonl"
    path.write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    with pytest.raises(ValueError, match=r"none.jsonl: no column 'demo'"):
        load_rows([path], Columns(prompt="prompt", answer="answer", demonstration="demo"))


def test_only_the_train_files_need_the_demonstration_column(tmp_path):
    """The warm-up reads the train rows' demonstrations; held-out files without them load and pass preflight."""
    demo = [{"role": "assistant", "content": "3"}]
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text(json.dumps({"prompt": "1+2=", "answer": "3", "demo": demo}) + "\n")
    val.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    spec = DataSpec(train_files=[str(train)], val_files=[str(val)], demonstration_key="demo")
    assert data_file_problems(spec) == []
    assert load_rows([val], val_columns(spec), field="data.val_files")[0].demonstration is None
    with pytest.raises(ValueError, match=r"val.jsonl: no column 'demo'"):
        load_rows([val], columns_of(spec))
    (problem,) = data_file_problems(DataSpec(train_files=[str(val)], demonstration_key="demo"))
    assert problem.path == "data.demonstration_key" and "data.train_files[0]" in problem.message
