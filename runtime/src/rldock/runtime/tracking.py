"""TensorBoard event files beside metrics.jsonl: one scalar per numeric metric per iteration.

`tensorboard --logdir <output>` then shows every metric the trainer logs (nested dicts such as
`timing` become `timing/<stage>`; lists such as the dock's per-warehouse traffic are left to
metrics.jsonl). Each attempt of a run writes its own event file in the same directory, which
TensorBoard reads as one run. A resumed attempt redoes the iterations after the last checkpoint,
whose scalars an earlier attempt may already have written: it opens its writer with
`purge_step` = the first step it writes, so TensorBoard hides the earlier attempt's events from
that step on and no step shows twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def scalars(record: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number in `record`, nested dicts joined with "/";
    the step (`iteration`), booleans, strings and lists are skipped."""
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from scalars(value, prefix=f"{tag}/")
        elif (isinstance(value, (int, float)) and not isinstance(value, bool) and tag != "iteration"
              and math.isfinite(value)):
            yield tag, float(value)


class TensorBoardLog:
    """A SummaryWriter over the run's output directory; `close` it when the attempt ends."""

    def __init__(self, output_dir: Path, *, first_step: int):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only where used

        self._writer = SummaryWriter(log_dir=str(output_dir), purge_step=first_step)

    def append(self, record: Mapping[str, Any]) -> None:
        """Write a metrics record's scalars at step `record["iteration"]` and flush, so a run that
        is killed keeps what it logged (as metrics.jsonl does)."""
        step = int(record["iteration"])
        for tag, value in scalars(record):
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
