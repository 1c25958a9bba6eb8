"""`rldock bench peak`: a device's peak matmul FLOP/s and memory bandwidth, measured once and cached."""

from __future__ import annotations

import argparse
import json
import sys


def add_commands(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure this machine (docs/evaluation.md#utilisation)")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    peak = bench_commands.add_parser(
        "peak",
        help="a device's peak matmul FLOP/s and memory bandwidth, the mfu/ and mbu/ metrics' denominators: "
        "measured once and cached in ${RLDOCK_CACHE:-~/.cache/rldock}/peak (a job reads the cache), printed as JSON",
    )
    peak.add_argument("--device", default="auto", choices=["auto", "npu", "cuda", "cpu"], help="default auto")
    peak.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="default float32")
    peak.add_argument("--remeasure", action="store_true", help="measure again and replace the cached figures")
    peak.set_defaults(run=run_peak)


def run_peak(args: argparse.Namespace) -> int:
    """The device's cached rates (runtime/peak.py), measured first if none."""
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
