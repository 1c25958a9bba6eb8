"""`rldock validate` (check a job config and every file it names, print one verdict line) and
`rldock train` (run it on a local or existing Ray): both read the config and run the same checks
before either answers or starts anything."""

from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from rldock.config import ConfigError, JobConfig, find_warnings, load_job_config
from rldock.contract import runtime_cli as cli
from rldock.contract.failure import FailureReason, format_failure
from rldock.contract.progress import headline_key
from rldock.runtime.cli.arguments import config_argument, overrides_argument, refuse
from rldock.runtime.preflight import failure_of, preflight
from rldock.runtime.sandbox.runner import describe_layers, machine_layers, uses_local_sandbox


def add_commands(commands: argparse._SubParsersAction) -> None:
    validate = commands.add_parser(
        cli.VALIDATE,
        help="check a job config and every file it names (model folder, data "
        "files and their keys, reward function files); print one verdict line",
    )
    config_argument(validate)
    overrides_argument(validate, example="algorithm.learning_rate=0")
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
    validate.set_defaults(run=run_validate)

    preempt = commands.add_parser(
        cli.PREEMPT,
        help="stop this machine's `rldock train` drivers as a pod's deletion would: each finishes its "
        "iteration, checkpoints it and exits; wait for them (an RLJob head pod's preStop hook)",
    )
    preempt.add_argument(
        cli.TIMEOUT, type=float, default=60.0, help="seconds to wait for the drivers to exit (default 60)"
    )
    preempt.add_argument(
        cli.NOTICE,
        type=os.path.expanduser,
        help="a file on storage the job's pods share: posted while the drivers stop, for the worker pods' hooks",
    )
    preempt.add_argument(
        cli.FOLLOW,
        action="store_true",
        help="signal nothing: wait while the --notice file says a driver is stopping (a worker pod's preStop "
        "hook, which keeps its Ray node up for the driver's last iteration)",
    )
    preempt.add_argument(
        cli.NO_DRAIN,
        action="store_true",
        help="with --follow: ask the driver for no checkpoint when this pod is deleted alone (a rollout pool's pod, "
        "whose loss costs its engine, not the attempt)",
    )
    preempt.set_defaults(run=run_preempt)

    train = commands.add_parser(cli.TRAIN, help="run a job: warm-up (if configured), then RL iterations")
    config_argument(train)
    train.add_argument(
        cli.OUTPUT, required=True, type=os.path.expanduser, help="directory for metrics, checkpoints and plots"
    )
    train.add_argument(cli.RESUME, action="store_true", help="continue from the latest checkpoint in --output")
    overrides_argument(train, example="algorithm.learning_rate=0")
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
    train.set_defaults(run=run_train)


def checked_config(
    args: argparse.Namespace, *, check_paths: bool, output: str | None, machine: bool
) -> JobConfig | int:
    """The job config `args` name with their overrides, checked (the files it names too, with
    `check_paths`, and `output` as a run's folder), its warnings printed; or the exit code of its refusal."""
    try:
        cfg = load_job_config(
            args.config,
            overrides=dict(args.overrides),
            check_local=False,
            paths="here" if check_paths else "as_written",
        )
    except ConfigError as error:
        return refuse(failure_of(FailureReason.INVALID_JOB_INPUT, error.problems), str(args.config), machine)
    failure = preflight(cfg, output=output) if check_paths else None
    if failure is not None:
        return refuse(failure, str(args.config), machine)
    for warning in find_warnings(cfg):
        print(f"warning: {warning}", file=sys.stderr)
    return cfg


def run_validate(args: argparse.Namespace) -> int:
    cfg = checked_config(args, check_paths=not args.no_path_checks, output=None, machine=False)
    if isinstance(cfg, int):
        return cfg
    if args.print_config:
        print(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False), end="")
    print(verdict(cfg, str(args.config), paths_checked=not args.no_path_checks))
    if uses_local_sandbox(cfg):
        assert cfg.agent is not None
        print(f"the python tool's sandbox on this machine: {describe_layers(machine_layers(cfg.agent.sandbox))}")
    return 0


def run_train(args: argparse.Namespace) -> int:
    # In an RLJob (`--no-progress`) a refusal is also printed as a failure line (arguments.refuse).
    cfg = checked_config(args, check_paths=True, output=args.output, machine=args.no_progress)
    if isinstance(cfg, int):
        return cfg
    # rldock draws one progress bar; per-load bars of transformers/huggingface_hub (in this
    # process and, through the inherited environment, in every Ray worker) would tear it.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from rldock.runtime.startup import collections_paused

    with collections_paused():  # heavy imports: torch, Ray, transformers (rldock.runtime.startup)
        from rldock.runtime.driver.attempt import CheckpointMismatch
        from rldock.runtime.driver.mismatch_budget import MismatchOverBudget
        from rldock.runtime.driver.preemption import EXIT_CODE, Preempted
        from rldock.runtime.driver.trainer import OutputDirInUse, Trainer
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
    except CheckpointMismatch as error:  # --resume of another job's checkpoint
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Preempted as stopped:  # SIGTERM: the iteration under way finished and was checkpointed
        print(f"stopped: {stopped}", file=sys.stderr)
        return EXIT_CODE
    except MismatchOverBudget as over:  # monitoring.mismatch `stop`: that iteration was checkpointed
        print(f"stopped: {over}", file=sys.stderr)
        if args.no_progress:  # in an RLJob: the operator fails it with the reason, no retry
            print(format_failure(over.failure()), flush=True)
        return 1
    print(json.dumps(run_summary(records, output=str(args.output))))
    return 0


def run_preempt(args: argparse.Namespace) -> int:
    import socket
    from pathlib import Path

    from rldock.runtime.driver.preemption import StopNotice, drain_request, follow_stop, stop_drivers

    notice = StopNotice(Path(args.notice)) if args.notice else None
    if args.follow:
        if notice is None:
            print(
                f"rldock preempt: {cli.FOLLOW} needs {cli.NOTICE}, the file the head pod's hook posts", file=sys.stderr
            )
            return 2
        # The pod's name is its hostname: its request for a checkpoint, should it be deleted alone (a drain)
        request = None if args.no_drain else drain_request(notice, socket.gethostname())
        followed = follow_stop(notice, args.timeout, request=request)
        print(f"rldock preempt: {'followed the driver' if followed else 'no driver answered'}")
        return 0
    if notice is not None:
        try:
            notice.post(args.timeout)
        except OSError as error:  # the drivers still stop; the worker pods' Ray nodes may not wait for them
            print(f"rldock preempt: could not post {notice.path} ({error})", file=sys.stderr)
    try:
        signalled, running = stop_drivers(args.timeout)
    finally:
        if notice is not None:
            notice.take_down()
    if running:
        print(f"rldock preempt: {len(running)} driver(s) still running after {args.timeout:g} s: {running}")
        return 1
    print(f"rldock preempt: {len(signalled)} driver(s) checkpointed and exited")
    return 0


def reward_failure(error: Exception) -> str:
    """The message of a reward term's failure, which reaches the driver wrapped by Ray (its str
    would be the worker's traceback): the last line of the job's log, so the RLJob's reason."""
    return str(getattr(error, "cause", error))


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


def verdict(cfg: JobConfig, source: str, *, paths_checked: bool) -> str:
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
