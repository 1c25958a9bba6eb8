"""`rldock agent capture`: run a job's harness once, on one train row, against the gateway (no model behind
it: every turn is answered with the row's answer), and write its first request's tools and system messages
to the file `agent.harness_request` names, which the job's prompts, and so its warm-up, are then rendered
with (docs/agentic.md#a-warm-up-the-gateway-agrees-with)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from rldock.runtime.cli.arguments import config_argument, overrides_argument


def add_commands(commands: argparse._SubParsersAction) -> None:
    agent = commands.add_parser("agent", help="your own agent (docs/agentic.md#bring-your-own-agent)")
    agent_commands = agent.add_subparsers(dest="agent_command", required=True)
    capture = agent_commands.add_parser(
        "capture",
        help="run the job's harness once against the gateway and write its first request's tools and system "
        "messages (agent.harness_request's file); print what was captured and whether the job's prompt ids "
        "equal the gateway's",
    )
    config_argument(capture)
    overrides_argument(capture, example="agent.episode_timeout_s=60")
    capture.add_argument(
        "--output",
        type=os.path.expanduser,
        help="the file to write; default: the config's agent.harness_request",
    )
    capture.add_argument("--row", type=int, default=0, metavar="N", help="the train row the harness runs (default 0)")
    capture.set_defaults(run=run_capture)


def run_capture(args: argparse.Namespace) -> int:
    """Exit 2 for a config that cannot run its harness here, 1 when the harness's first request cannot be
    captured, else 0 with the file written and one JSON line on stdout."""
    from rldock.runtime.cli.job_commands import checked_config

    named = _named_file(args)
    if named is not None:  # the file this writes is the one the config names: it need not exist yet
        args.overrides = [*args.overrides, ("agent.harness_request", None)]
    cfg = checked_config(args, check_paths=True, output=None, machine=False)
    if isinstance(cfg, int):
        return cfg
    output = args.output or named
    if output is None:
        print("error: --output: the config names no agent.harness_request; give the file to write", file=sys.stderr)
        return 2
    if cfg.agent is None or not cfg.agent.harnessed:
        print(
            "error: agent: the job runs no harness (agent.harness or agent.harness_command) to capture", file=sys.stderr
        )
        return 2
    from rldock.runtime.chat.harness_request import HarnessRequestError
    from rldock.runtime.driver.inputs import load_prompt_set, prepare_base_model
    from rldock.runtime.gateway.capture import capture_first_request
    from rldock.runtime.models.loading import load_tokenizer
    from rldock.runtime.rollout.harness import task_of

    with tempfile.TemporaryDirectory(prefix="rldock-capture-") as scratch:  # a generator's files
        _, rows = load_prompt_set(cfg, Path(scratch))
    if not 0 <= args.row < len(rows):
        print(f"error: --row: {args.row} is not a train row (0 to {len(rows) - 1})", file=sys.stderr)
        return 2
    row = rows[args.row]
    try:
        capture = capture_first_request(
            # the job's tokenizer: a model.builder's tiny model is built first, as the job builds it
            cfg,
            tokenizer=load_tokenizer(prepare_base_model(cfg, rows)),
            task=task_of(row, args.row),
            prompt=row.prompt,
        )
    except HarnessRequestError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(capture.request.to_json())
    print(json.dumps({"output": str(output), **capture.summary}))
    return 0


def _named_file(args: argparse.Namespace) -> str | None:
    """The config's agent.harness_request (expanded as the job expands it), or None (also for a config that
    does not load: checked_config then says why)."""
    from rldock.config import ConfigError, load_job_config

    try:
        cfg = load_job_config(args.config, overrides=dict(args.overrides), check_local=False, paths="here")
    except ConfigError:
        return None
    return None if cfg.agent is None else cfg.agent.harness_request
