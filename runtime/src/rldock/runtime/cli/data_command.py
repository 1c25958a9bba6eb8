"""`rldock data generate`: the rows a job's `data.generator` writes (or the cabinet environment's
tasks), as train and val jsonl files to keep."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_commands(commands: argparse._SubParsersAction) -> None:
    data = commands.add_parser("data", help="work with data files")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    generate = data_commands.add_parser("generate", help="write a generator's train (and val) rows as jsonl files")
    generate.add_argument(
        "generator",
        choices=["addition", "word_problems", "cabinet"],
        help="cabinet: tasks of the cabinet environment (rldock.runtime.agent.examples.cabinet:Cabinet), each "
        "with its demonstration and the extra_info the environment rebuilds its files from",
    )
    generate.add_argument("--num-train", type=int, default=1000, metavar="N", help="train rows (default 1000)")
    generate.add_argument("--num-val", type=int, default=0, metavar="M", help="validation rows (default 0)")
    generate.add_argument(
        "--output",
        "--out",
        dest="out",
        required=True,
        type=os.path.expanduser,
        help="directory for train.jsonl and val.jsonl",
    )
    generate.add_argument("--seed", type=int, default=0, help="the rows are a pure function of it (default 0)")
    # The generators' own flags default to None: the generator's defaults apply, and a flag of the
    # other generator is refused instead of ignored (GENERATOR_FLAGS).
    generate.add_argument("--max-operand", type=int, help="addition: largest operand (default 99)")
    generate.add_argument(
        "--operations", help="word_problems: comma-separated kinds drawn (default add,subtract,multiply,share)"
    )
    generate.add_argument(
        "--max-number", type=int, help="word_problems: largest number added or given away (default 20)"
    )
    generate.add_argument(
        "--max-factor", type=int, help="word_problems: largest factor of products and shares (default 10)"
    )
    generate.add_argument("--num-files", type=int, help="cabinet: files in each task's directory (default 4)")
    generate.add_argument("--num-lines", type=int, help="cabinet: codes in each file (default 3)")
    generate.add_argument(
        "--tool-demonstrations",
        choices=["python", "calculator"],
        default=None,
        help="also write each row solved with this tool, in the column `demonstration` (data.demonstration_key)",
    )
    generate.add_argument(
        "--prompt-key",
        default=None,
        help="column of the prompt (default: question for word_problems, as GSM8K; else prompt)",
    )
    generate.add_argument("--answer-key", default="answer", help="column of the answer (default answer)")
    generate.set_defaults(run=run_generate)


# `rldock data generate`'s flag for each config field it fills, so an error names what was typed.
GENERATE_FLAGS = {
    "num_prompts": "--num-train",
    "num_val_prompts": "--num-val",
    "max_operand": "--max-operand",
    "operations": "--operations",
    "max_number": "--max-number",
    "max_factor": "--max-factor",
    "num_files": "--num-files",
    "num_lines": "--num-lines",
    "prompt_key": "--prompt-key",
    "answer_key": "--answer-key",
}


# The flags only one generator reads (their config fields): another generator's flag is an error.
GENERATOR_FLAGS = {
    "addition": ("max_operand",),
    "word_problems": ("operations", "max_number", "max_factor"),
    "cabinet": ("num_files", "num_lines"),
}


def run_generate(args: argparse.Namespace) -> int:
    """The same rows a job's `data.generator` writes, as files to keep."""
    from pydantic import ValidationError

    from rldock.config.data import DataSpec, GeneratorSpec
    from rldock.runtime.data import generate_files
    from rldock.runtime.data.generators import column_names

    prompt_key = args.prompt_key or ("question" if args.generator == "word_problems" else "prompt")
    given = {field: getattr(args, field) for fields in GENERATOR_FLAGS.values() for field in fields}
    given = {field: value for field, value in given.items() if value is not None}
    foreign = [field for field in given if field not in GENERATOR_FLAGS[args.generator]]
    if foreign:
        flags = ", ".join(GENERATE_FLAGS[field] for field in foreign)
        print(f"error: {flags}: not read by the {args.generator} generator; drop it", file=sys.stderr)
        return 2
    if args.generator == "cabinet":  # not a data.generator: its files are for data.train_files
        return generate_cabinet_tasks(args, given, prompt_key)
    if "operations" in given:
        given["operations"] = given["operations"].split(",")
    try:
        spec = GeneratorSpec(
            name=args.generator,
            num_prompts=args.num_train,
            num_val_prompts=args.num_val,
            tool_demonstrations=args.tool_demonstrations,
            **given,
        )
        columns = column_names(DataSpec(generator=spec, prompt_key=prompt_key, answer_key=args.answer_key))
    except ValidationError as error:
        for problem in error.errors():
            name = str(problem["loc"][0]) if problem["loc"] else ""
            flag = GENERATE_FLAGS.get(name, name)
            print(f"error: {flag}: {problem['msg']} (got {problem['input']!r})", file=sys.stderr)
        return 2
    files = generate_files(spec, Path(args.out), seed=args.seed, columns=columns)
    keys = {"prompt_key": prompt_key, "answer_key": args.answer_key}
    if spec.tool_demonstrations is not None:
        keys["demonstration_key"] = columns["demonstration"]
    print(json.dumps({"train": files.train, "val": files.val, **keys}))
    return 0


def generate_cabinet_tasks(args: argparse.Namespace, given: dict, prompt_key: str) -> int:
    """`rldock data generate cabinet`: the cabinet environment's tasks, with their demonstrations and the
    extra_info the environment rebuilds each task from (rldock.runtime.agent.examples.cabinet_tasks)."""
    from rldock.config.data import DataSpec
    from rldock.runtime.agent.examples.cabinet_tasks import generate_cabinet
    from rldock.runtime.data.generators import column_names, write_rows

    if args.tool_demonstrations is not None:
        print("error: --tool-demonstrations: the cabinet rows always show their own commands; drop it", file=sys.stderr)
        return 2
    if args.num_train < 1 or args.num_val < 0:
        flag, value = ("--num-train", args.num_train) if args.num_train < 1 else ("--num-val", args.num_val)
        print(f"error: {flag}: too few rows (got {value})", file=sys.stderr)
        return 2
    try:
        rows = generate_cabinet(num_train=args.num_train, num_val=args.num_val, seed=args.seed, **given)
    except ValueError as error:
        print(f"error: --num-files, --num-lines: {error}", file=sys.stderr)
        return 2
    columns = column_names(DataSpec(prompt_key=prompt_key, answer_key=args.answer_key))
    files = write_rows(rows, Path(args.out), columns=columns)
    keys = {
        "prompt_key": prompt_key,
        "answer_key": args.answer_key,
        "demonstration_key": columns["demonstration"],
        "extra_info_key": columns["extra_info"],
    }
    print(json.dumps({"train": files.train, "val": files.val, **keys}))
    return 0
