"""The `rldock` command line: validate a job config, plan its memory per device (`rldock plan`), train
it on a local or existing Ray, prepare data (`rldock data generate`) or a model (`rldock models
import-gguf`), serve an environment class over OpenEnv's protocol (`rldock env serve`), capture what your own agent
sends (`rldock agent capture`), or measure a device's peak (`rldock bench peak`).

One module per command (or per family: validate and train share their checks); each adds its
parser with `add_commands` and sets the function that runs it, which `main` calls. A command's
heavy imports (torch, Ray, vLLM, transformers) happen inside that function, so `rldock validate`
and `--help` start without them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging

from rldock.contract import runtime_cli as cli
from rldock.runtime.cli import (
    agent_command,
    bench_command,
    data_command,
    env_command,
    job_commands,
    models_command,
    plan_command,
)

# In the order `rldock --help` lists them.
COMMANDS = (job_commands, plan_command, data_command, models_command, bench_command, env_command, agent_command)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=cli.PROGRAM, description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('rldock')}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.run(args))
