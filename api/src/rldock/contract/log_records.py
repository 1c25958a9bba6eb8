"""Machine-readable log lines: a fixed prefix, then one JSON document (the progress line and the
failure line both travel this way through the Ray job log)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def prefixed_records(log_lines: Iterable[str], prefix: str) -> Iterator[Any]:
    """The JSON documents after `prefix` in `log_lines`, in order; lines without the prefix, and
    lines cut by log rotation or a crash mid-write, are skipped."""
    for line in log_lines:
        start = line.find(prefix)
        if start < 0:
            continue
        try:
            yield json.loads(line[start + len(prefix) :])
        except json.JSONDecodeError:
            continue
