"""Reading each job's driver log once: where it was read up to, and the last progress record.

The reconciler reads a driver's log as its last 1,000 lines (rayjobs.py: Ray 2.60's state API
serves a driver log's tail, but no byte range of it), or whole where the tail cannot be had (no
driver yet); either way capped at 1 MiB. Per RLJob this keeps the offset up to which the text was
parsed (always a line end), a short fingerprint of the text before it, and the last progress
record found; a read that continues the previous one parses only the complete lines after the
offset. A tail that moved on is not a continuation and is parsed whole (at most 1,000 lines): a
progress record followed by more than 1,000 other lines within one poll is missed, and the status
keeps the previous one until the next record.

A log that is shorter than the offset, or whose text before the offset changed, is a new log (the
same attempt resubmitted to a new head after unsuspend, or an operator restarted): it is parsed
from the start. Memory per RLJob is one record and a 128-character fingerprint, never the log; an
RLJob is forgotten when it finishes or is deleted, and at most `max_jobs` are kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from rldock.contract.progress import last_progress

FINGERPRINT = 128


@dataclass
class _Read:
    submission_id: str
    offset: int = 0  # characters of the log parsed so far; a line end
    fingerprint: str = ""  # the FINGERPRINT characters before `offset`
    record: dict[str, Any] | None = None  # the last progress record up to `offset`


class ProgressCursor:
    def __init__(self, *, max_jobs: int = 10_000) -> None:
        self._reads: OrderedDict[Hashable, _Read] = OrderedDict()
        self._max_jobs = max_jobs

    def last_record(self, key: Hashable, submission_id: str, log_text: str) -> dict[str, Any] | None:
        """The last well-formed progress record in `log_text`, the log of `submission_id` now,
        parsing only what was not parsed at the previous call for `key` (an RLJob)."""
        read = self._reads.get(key)
        if read is None or read.submission_id != submission_id or not _continues(read, log_text):
            read = _Read(submission_id)
        end = log_text.rfind("\n", read.offset) + 1  # complete lines only: a line may be half written
        if end > read.offset:
            record = last_progress(log_text[read.offset : end].splitlines())
            read.record = record if record is not None else read.record
            read.offset = end
            read.fingerprint = log_text[max(0, end - FINGERPRINT) : end]
        self._reads[key] = read
        self._reads.move_to_end(key)
        while len(self._reads) > self._max_jobs:
            self._reads.popitem(last=False)
        return read.record

    def forget(self, key: Hashable) -> None:
        self._reads.pop(key, None)

    def __len__(self) -> int:
        return len(self._reads)


def _continues(read: _Read, log_text: str) -> bool:
    """Whether `log_text` is the log that was read, grown (not a new one)."""
    return len(log_text) >= read.offset and log_text.startswith(read.fingerprint, read.offset - len(read.fingerprint))
