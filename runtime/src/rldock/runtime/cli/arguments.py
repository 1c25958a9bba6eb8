"""What the commands' parsers share: the job config argument and its `--set` overrides, the value
types their flags take, and the refusal every command that reads a job config prints."""

from __future__ import annotations

import argparse
import os
import re
import sys

import yaml

from rldock.contract import runtime_cli as cli
from rldock.contract.failure import JobFailure, format_failure


def parse_override(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    return key, yaml.safe_load(raw)  # so "0", "true", "1e-4" become numbers and booleans


def config_argument(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get(cli.JOB_CONFIG_ENV)
    parser.add_argument(
        "config",
        nargs="?" if default else None,
        default=default,
        help=f"the job config (YAML); default: ${cli.JOB_CONFIG_ENV}, which RLJob pods set",
    )


def overrides_argument(parser: argparse.ArgumentParser, *, example: str) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        type=parse_override,
        default=[],
        metavar="KEY=VALUE",
        help=f"override a field, e.g. {example}",
    )


def parse_option(text: str) -> tuple[str, str]:
    key, equals, value = text.partition("=")
    if not equals or not key:
        raise argparse.ArgumentTypeError(f"--option expects key=value, got {text!r}")
    return key, value  # kept a string, as agent.environment.options are


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expects a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


# A size's unit, case-insensitive; a number with no unit is GiB (device memory is quoted in GiB:
# `resources.device_memory_gib`), so `--device-memory 64` means 64 GiB, never 64 bytes.
MEMORY_UNITS = {"gib": 1024**3, "gb": 10**9, "tib": 1024**4, "tb": 10**12, "mib": 1024**2, "mb": 10**6}


def parse_memory(text: str) -> int:
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


def refuse(failure: JobFailure, source: str, machine: bool) -> int:
    """Print why the job config `source` is refused (exit 2); with `machine` (an RLJob's
    `--no-progress`) also as a failure line, which the operator turns into a condition naming the
    fields instead of retrying the job."""
    lines = "\n".join(f"  - {problem}" for problem in failure.problems)
    print(f"invalid job config {source}:\n{lines}", file=sys.stderr)
    if machine:
        print(format_failure(failure), flush=True)
    return 2
