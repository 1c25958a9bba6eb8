"""The progress line: how a running job tells the operator where it is, through its Ray job log.

The trainer prints one such line per finished iteration (and one per checkpoint); the operator
tails the Ray job's log through the Jobs API and keeps the last one it parsed. A log line needs no
shared volume, no extra port and survives operator restarts (the log is replayed from the start).
Both sides import this module, so the format has one definition.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from rldock.contract.log_records import prefixed_records

PREFIX = "RLDOCK_PROGRESS "


def format_progress(record: dict[str, Any]) -> str:
    return PREFIX + json.dumps(record, separators=(",", ":"), sort_keys=True)


def headline_key(record: Mapping[str, Any]) -> str:
    """The metric that says whether a run learns: the sampled reward, or for DPO (which samples
    nothing) the share of preference pairs the policy itself ranks right."""
    return "reward_mean" if "reward_mean" in record else "policy_preference_accuracy"


# The iteration's train-inference mismatch, `mismatch/kl` (a job that measures it: algorithm.rollout_correction
# or monitoring.mismatch), which the operator holds to monitoring.mismatch.max_kl.
MISMATCH_KL = "mismatch_kl"

# What a stop asked by SIGTERM (a preemption) may take now: the last iteration's seconds (its cycle, in a
# run-ahead schedule), which the iteration under way may need to finish, and the last checkpoint's save.
# The operator holds their sum to what spec.preemption.gracePeriodSeconds leaves the driver.
ITERATION_S, CHECKPOINT_S = "iteration_s", "checkpoint_s"
# Until the first checkpoint measures its save, the driver's estimate of it (rldock.runtime.planning.checkpoint_size:
# the bytes a checkpoint writes at the write rate measured in the output folder) stands in for CHECKPOINT_S.
CHECKPOINT_ESTIMATE_S = "checkpoint_estimate_s"

# The last evaluation, carried on every progress line after it (the operator keeps only the last
# line, and most iterations do not evaluate): its iteration (0: the initial policy), mean reward
# and accuracy on the held-out prompts.
VAL_ITERATION, VAL_REWARD, VAL_ACCURACY = "val_iteration", "val_reward", "val_accuracy"


def evaluation_headline(record: dict[str, Any] | None) -> dict[str, Any]:
    """The progress-line keys of the last evaluation from its metrics record (`val/reward`,
    `val/accuracy`), or {} when there was none yet."""
    if record is None:
        return {}
    return {
        VAL_ITERATION: int(record["iteration"]),
        VAL_REWARD: round(float(record["val/reward"]), 4),
        VAL_ACCURACY: round(float(record["val/accuracy"]), 4),
    }


def last_progress(log_lines: Iterable[str]) -> dict[str, Any] | None:
    """The last well-formed progress record in a log, or None; other lines are ignored."""
    last = None
    for record in prefixed_records(log_lines, PREFIX):
        if isinstance(record, dict):
            last = record
    return last
