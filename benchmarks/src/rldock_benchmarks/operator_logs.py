"""The operator's CPU for reading running jobs' driver logs: whole log every poll vs only what is new.

Every poll (5 s) the reconciler asks each running job's Jobs API for its driver log and takes the
last progress line from it. Ray 2.60 answers the whole log each time (no offset), so the client
always decodes the whole JSON body; what differs is the parsing:

- whole:       observe.read_progress(log), i.e. splitlines + scan of the whole log, every poll
               (what the operator did before);
- incremental: progress_cursor.ProgressCursor, which parses only the complete lines added since
               the previous poll, and observe.progress_of.

Simulated: --jobs logs that already hold --initial-lines lines, each growing by --lines-per-poll
lines per poll (one progress line every --progress-every lines, the rest Ray/vLLM chatter), for
--polls polls. Measured with time.process_time in this process: the JSON decode of each Jobs API
body (the same for both) and the parsing. Prints one JSON document with both approaches side by
side and their ratios, per poll of all jobs and as a share of one core at the poll interval.

    python -m rldock_benchmarks.operator_logs --jobs 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from rldock.contract.progress import format_progress
from rldock.operator.observe import progress_of, read_progress
from rldock.operator.progress_cursor import ProgressCursor

CHATTER = (
    "(RolloutWorker pid=4711) INFO 01-01 12:00:00 metrics.py:351] Avg prompt throughput: 812.4 tokens/s, "
    "Running: 32 reqs\n"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=100)
    parser.add_argument("--initial-lines", type=int, default=20_000, help="log lines each job already has")
    parser.add_argument("--lines-per-poll", type=int, default=40)
    parser.add_argument("--progress-every", type=int, default=40, help="one progress line per this many lines")
    parser.add_argument("--polls", type=int, default=12)
    parser.add_argument("--poll-interval", type=float, default=5.0, help="seconds (the operator's pollInterval)")
    return parser.parse_args(argv)


def _progress_line(iteration: int) -> str:
    return (
        format_progress(
            {
                "iteration": iteration,
                "reward_mean": 0.5,
                "tokens_per_s_per_device": 1500.0,
                "kl": 0.01,
                "checkpoint": iteration - iteration % 10 or None,
            }
        )
        + "\n"
    )


def _grow(lines: int, start: int, every: int) -> str:
    return "".join(
        _progress_line((start + i) // every) if (start + i) % every == every - 1 else CHATTER for i in range(lines)
    )


def run(args: argparse.Namespace) -> dict:
    logs = [_grow(args.initial_lines, 0, args.progress_every) for _ in range(args.jobs)]
    written = args.initial_lines
    cursor = ProgressCursor()
    per_poll: dict[str, list[float]] = {"decode": [], "whole": [], "incremental": []}
    answers_agree = True
    for _ in range(args.polls):
        added = _grow(args.lines_per_poll, written, args.progress_every)
        written += args.lines_per_poll
        logs = [log + added for log in logs]
        bodies = [json.dumps({"logs": log}) for log in logs]  # what the head sends (not timed)

        start = time.process_time()
        texts = [json.loads(body)["logs"] for body in bodies]
        per_poll["decode"].append(time.process_time() - start)

        start = time.process_time()
        whole = [read_progress(text, output_dir="/checkpoints/ns/job/uid") for text in texts]
        per_poll["whole"].append(time.process_time() - start)

        start = time.process_time()
        incremental = [
            progress_of(cursor.last_record(job, "attempt-0", text), output_dir="/checkpoints/ns/job/uid")
            for job, text in enumerate(texts)
        ]
        per_poll["incremental"].append(time.process_time() - start)
        answers_agree = answers_agree and whole == incremental

    # The first incremental poll parses every whole log once (an operator start); the steady
    # state is every later poll.
    steady = {name: statistics.median(values[1:] if len(values) > 1 else values) for name, values in per_poll.items()}
    log_bytes = len(logs[0].encode())

    def side(parse: float) -> dict:
        total = steady["decode"] + parse
        return {
            "parse_cpu_s_per_poll": round(parse, 6),
            "decode_plus_parse_cpu_s_per_poll": round(total, 6),
            "core_share_at_poll_interval": round(total / args.poll_interval, 5),
        }

    return {
        "benchmark": "operator_logs",
        "jobs": args.jobs,
        "polls": args.polls,
        "poll_interval_s": args.poll_interval,
        "log_lines_per_job_at_end": written,
        "log_bytes_per_job_at_end": log_bytes,
        "bytes_transferred_per_poll_all_jobs": log_bytes * args.jobs,
        "note": (
            "Ray 2.60's GET /api/jobs/<id>/logs has no offset: both approaches receive and decode the "
            "whole body; only the parsing differs. First incremental poll (operator start) parses "
            "every whole log once and is excluded from the steady state."
        ),
        "json_decode_cpu_s_per_poll": round(steady["decode"], 6),
        "whole": side(steady["whole"]),
        "incremental": side(steady["incremental"]),
        "incremental_first_poll_parse_cpu_s": round(per_poll["incremental"][0], 6),
        "ratio_parse_whole_over_incremental": round(steady["whole"] / max(steady["incremental"], 1e-9), 1),
        "ratio_total_whole_over_incremental": round(
            (steady["decode"] + steady["whole"]) / max(steady["decode"] + steady["incremental"], 1e-9), 2
        ),
        "same_progress_reported": answers_agree,
        "cursor_entries": len(cursor),
    }


def main(argv: list[str] | None = None) -> int:
    json.dump(run(parse_args(argv)), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
