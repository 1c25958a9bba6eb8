"""A warehouse's columns in shared memory, so workers on its node read and write rows in place.

A Ray call that carries a megabyte costs about five times the CPU of a call that carries only
metadata, nearly all of it in Ray's object store (the caller's copy in, the raylet, the callee's
map; docs/dock-benchmarks.md, "Shared-memory rows"). A worker on the warehouse's own node needs
none of that: the warehouse keeps each column in a file under /dev/shm, and the worker maps the
same file, so its read or write of rows is a memory copy, and its only Ray call per request is the
small one to the controller (which samples, and readiness after a write).

Layout of one warehouse's directory `<root>/rldock-<token>` (the token is new for every warehouse
process, so a restarted warehouse never shares files with the one it replaces):
- `columns.json`: {column name: {"file", "dtype" (torch's, by name), "wire" (numpy), "shape"}}, rewritten
  atomically when the owner allocates a column (a writer's first write goes through the owner);
- `<n>.rows` and `<n>.written`: the column's (capacity, *shape) rows and its per-row "written this
  iteration" flags;
- `counters`: the warehouse's traffic counters, updated under a file lock by every process;
- `owner`: the owner's pid; a new warehouse removes directories whose owner is gone (a warehouse
  killed with SIGKILL cannot remove its own).

Only the owner allocates (the warehouse actor, or the controller host for its hosted warehouses),
so allocation needs no cross-process lock. Space is reserved with posix_fallocate: a full /dev/shm
then fails the allocation (the column stays in private memory, served by Ray calls as before)
instead of killing a writer with SIGBUS on its first touch of a page.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "/dev/shm"
_PREFIX = "rldock-"
COUNTERS = (
    "bytes_in",
    "bytes_out",
    "expanded_bytes",
    "write_requests",
    "read_requests",
    "shared_write_requests",
    "shared_read_requests",
)


class SharedColumn(NamedTuple):
    """One column as mapped by this process: its rows (wire dtype), written flags and torch dtype (by name)."""

    rows: np.ndarray
    written: np.ndarray
    dtype: str


class SharedColumns:
    """The shared-memory files of one warehouse, as its owner made them or as a worker attached them."""

    def __init__(self, directory: Path, capacity: int, *, owner: bool) -> None:
        self.directory = directory
        self._capacity = capacity
        self._owner = owner
        self._mapped: dict[str, SharedColumn] = {}
        self._catalog: dict[str, dict] = {}
        self.counters = np.memmap(directory / "counters", dtype=np.int64, mode="r+", shape=(len(COUNTERS),))
        self.owner_pid = int((directory / "owner").read_text())

    @classmethod
    def create(cls, root: str, capacity: int) -> SharedColumns | None:
        """A new directory under `root` owned by this process; None (with a warning) if `root` cannot take it."""
        base = Path(root)
        if not base.is_dir() or not os.access(base, os.W_OK):
            logger.warning(
                "transfer dock: %s is not a writable directory; warehouse rows stay in private "
                "memory and every read and write is a Ray call",
                root,
            )
            return None
        remove_orphans(base)
        directory = base / f"{_PREFIX}{uuid.uuid4().hex}"
        directory.mkdir(mode=0o700)
        (directory / "owner").write_text(str(os.getpid()))
        with open(directory / "counters", "wb") as f:
            f.write(bytes(8 * len(COUNTERS)))
        _write_catalog(directory, {})
        return cls(directory, capacity, owner=True)

    @classmethod
    def attach(cls, directory: str, capacity: int) -> SharedColumns:
        """The files of the warehouse at `directory`, for reads and writes of columns it has allocated."""
        return cls(Path(directory), capacity, owner=False)

    def allocate(self, name: str, dtype: str, wire: np.dtype, shape: tuple[int, ...]) -> SharedColumn | None:
        """(Owner) a new zero-filled column; None if shared memory has no room for it."""
        assert self._owner, "only the warehouse that owns the files allocates columns"
        stem = str(len(self._catalog))
        nbytes = self._capacity * int(np.prod(shape, dtype=np.int64)) * np.dtype(wire).itemsize
        try:
            for suffix, size in ((".rows", nbytes), (".written", self._capacity)):
                fd = os.open(self.directory / (stem + suffix), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    if size:
                        os.posix_fallocate(fd, 0, size)
                finally:
                    os.close(fd)
        except OSError as err:
            logger.warning(
                "transfer dock: no shared memory for column %r (%d bytes: %s); it stays in private "
                "memory and its reads and writes are Ray calls",
                name,
                nbytes,
                err,
            )
            for suffix in (".rows", ".written"):
                (self.directory / (stem + suffix)).unlink(missing_ok=True)
            return None
        self._catalog[name] = {
            "file": stem,
            "dtype": dtype,
            "wire": np.dtype(wire).str,
            "shape": list(shape),
        }
        _write_catalog(self.directory, self._catalog)
        return self.column(name)

    def column(self, name: str) -> SharedColumn | None:
        """Column `name` mapped here, or None if the owner has not allocated it (yet)."""
        if name in self._mapped:
            return self._mapped[name]
        if name not in self._catalog:
            self._catalog = json.loads((self.directory / "columns.json").read_text())
            if name not in self._catalog:
                return None
        entry = self._catalog[name]
        shape = (self._capacity, *entry["shape"])
        wire = np.dtype(entry["wire"])
        # Plain ndarray views of the maps: they pickle (a warehouse actor's reply) as arrays.
        rows = (
            np.memmap(self.directory / (entry["file"] + ".rows"), dtype=wire, mode="r+", shape=shape)
            if shape[0] * int(np.prod(shape[1:], dtype=np.int64))
            else np.zeros(shape, dtype=wire)
        )
        written = np.memmap(
            self.directory / (entry["file"] + ".written"), dtype=np.bool_, mode="r+", shape=(self._capacity,)
        )
        self._mapped[name] = SharedColumn(rows.view(np.ndarray), written.view(np.ndarray), entry["dtype"])
        return self._mapped[name]

    def owner_alive(self) -> bool:
        """Whether the owning process still runs (a worker on its node shares its pid namespace): rows
        of a dead warehouse must fail like a call to it would, not live on in shared memory."""
        return process_runs(self.owner_pid)

    @contextmanager
    def counting(self) -> Iterator[np.ndarray]:
        """The counters, locked against the other processes that update them."""
        with open(self.directory / "counters", "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield self.counters
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def remove(self) -> None:
        """(Owner) delete the directory; processes that mapped its files keep their mappings."""
        if self._owner:
            shutil.rmtree(self.directory, ignore_errors=True)


def remove_orphans(root: Path) -> list[Path]:
    """Remove the warehouse directories under `root` whose owner process is gone; the removed ones."""
    removed = []
    for directory in root.glob(_PREFIX + "*"):
        try:
            pid = int((directory / "owner").read_text())
        except (OSError, ValueError):
            continue  # being created, or not ours
        if not process_runs(pid):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    return removed


def process_runs(pid: int) -> bool:
    """Whether `pid` runs: exists and is not a zombie (a killed actor's process is one until its
    raylet reaps it, and Ray may already report the actor dead)."""
    try:  # os.open/os.read rather than pathlib: every put and get of a worker asks, so it is on the hot path
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence is all we can tell
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        stat = os.read(fd, 4096)
    except ProcessLookupError:  # reaped between the open and the read: the kernel answers ESRCH
        return False
    finally:
        os.close(fd)
    if not stat:  # the process ended between the open and the read
        return False
    state = stat[stat.rindex(b")") + 2 :][:1]  # the field after the command name, which may hold spaces
    return state not in (b"Z", b"X")


def _write_catalog(directory: Path, catalog: dict) -> None:
    temporary = directory / "columns.json.tmp"
    temporary.write_text(json.dumps(catalog))
    temporary.replace(directory / "columns.json")  # readers see the old or the new catalog, whole
