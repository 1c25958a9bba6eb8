"""`rldock plan`: the job's memory per device (training and generation phases), and a refusal of a
config that cannot fit, naming the field to change."""

from __future__ import annotations

import argparse
import json
import sys

from rldock.config import ConfigError, load_job_config
from rldock.contract.failure import FailureReason
from rldock.runtime.cli.arguments import config_argument, overrides_argument, parse_memory, refuse
from rldock.runtime.preflight import failure_of


def add_commands(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser(
        "plan",
        help="print the job's memory per device (training and generation phases) "
        "and refuse a config that cannot fit, naming the field to change",
    )
    config_argument(plan)
    overrides_argument(plan, example="training.strategy=fsdp")
    plan.add_argument(
        "--device-memory",
        type=parse_memory,
        default=None,
        metavar="SIZE",
        help="memory of one device: 64 (GiB), 64GiB, 80GB; units GiB (the default), GB, TiB, TB, "
        "MiB, MB (default: resources.device_memory_gib)",
    )
    plan.add_argument(
        "--model-preset",
        default=None,
        help="a built-in model shape instead of model.path's config.json: qwen2.5-7b, qwen2.5-32b, qwen3-30b-a3b, "
        "deepseek-r1-671b",
    )
    plan.add_argument(
        "--write-rate",
        type=parse_memory,
        default=parse_memory("0.5GiB"),
        metavar="SIZE",
        help="what the checkpoint folder's storage writes a second, for the estimate of a checkpoint's save "
        "(default 0.5GiB; a job measures its own at the start)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (bytes)")
    plan.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    """Exit 0 when the job fits (or no device memory is known), 3 when it cannot."""
    from rldock.runtime.planning import check_fit, load_shape, plan_memory
    from rldock.runtime.planning.checkpoint_size import SaveEstimate, checkpoint_bytes
    from rldock.runtime.planning.report import plan_json, plan_table

    try:
        # planned here, run elsewhere: a variable set only where it runs stays as written
        cfg = load_job_config(args.config, overrides=dict(args.overrides), check_local=False, paths="if_set")
    except ConfigError as error:
        return refuse(failure_of(FailureReason.INVALID_JOB_INPUT, error.problems), str(args.config), False)
    try:
        shape = load_shape(preset=args.model_preset, model_path=cfg.model.path)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    plan = plan_memory(cfg, shape, device_memory=args.device_memory)
    verdict = None if plan.device_memory is None else check_fit(cfg, shape, device_memory=plan.device_memory)
    save = SaveEstimate(checkpoint_bytes(cfg, shape), write_rate=args.write_rate)
    print(json.dumps(plan_json(plan, verdict, save)) if args.json else plan_table(plan, verdict, save))
    return 3 if verdict is not None and not verdict.fits else 0
