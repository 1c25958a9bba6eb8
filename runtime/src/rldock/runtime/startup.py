"""What starting a job costs, per process: CPU seconds before, in and after each actor's constructor.

A job's first iteration waits for every process it starts: the driver (its imports, its inputs and
warm-up), each device worker (vLLM's and torch's imports, the model, the engine), the reward worker,
the dock's actors. Each Ray actor the job creates is `timed`: a subclass of its class that notes the
process's CPU time (all its threads) as its constructor starts and ends, and answers `startup()`
with three figures:

- `before_init_cpu`: the process's CPU before the constructor ran: the interpreter, Ray's worker
  and the imports of the actor's modules (Ray imports them to unpickle the class);
- `init_cpu`: the constructor's (a model loaded, a tokenizer read, the dock's columns laid out);
- `setup_cpu`: since then, until the driver asks, just before the first iteration: the calls that
  set the process up (process groups joined, generation engines built) and whatever its threads did.

The driver adds its own (`driver_startup`: imports, inputs with the warm-up and, beside them, Ray's
start, then the attempt) and the wall time from its process's start to the first iteration; `startup_timing`
sums them by process kind into the first record's `timing/startup`. CPU of Ray's own processes
(GCS, raylet) is not here: rldock_benchmarks.startup measures whole process trees from outside.

Start-up runs without the cyclic garbage collector (`collections_paused`). Importing torch,
transformers and vLLM creates about a million objects that all live on, and the collector walks the
survivors again at every older-generation pass: in a fresh interpreter here `from vllm import LLM`
took 6.2 CPU seconds collecting as usual and 4.6 with the collector off (3 runs each). The pauses are
the three heavy stretches of a job's start: a Ray worker's from its process's start (`pause_collections`,
the job's worker set-up hook) to the end of its actor's constructor, the generation engine's build,
and the driver's imports and inputs. Reference counting frees everything else meanwhile; only
garbage in cycles waits for the collector's next pass after the pause.
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The phases, as the first record names them (timing/startup/<kind>/<phase>).
PHASES = ("before_init_cpu", "init_cpu", "setup_cpu")


@dataclass(frozen=True)
class ProcessStartup:
    """One process's start-up CPU seconds (module docstring); `kind` is its actor class's name."""

    kind: str
    before_init_cpu: float
    init_cpu: float
    setup_cpu: float


def timed(cls: type[T]) -> type[T]:
    """`cls` with its start-up measured: a subclass of the same name whose constructor notes the
    process's CPU time around `cls`'s, and which answers `startup()` (a ProcessStartup)."""

    constructor: Any = cls.__init__

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        before = time.process_time()
        try:
            constructor(self, *args, **kwargs)
        finally:
            resume_collections()  # paused since the process started (pause_collections)
        self._startup_cpu = (before, time.process_time())

    if inspect.isfunction(constructor):  # Ray checks the actor's arguments against this signature
        __init__ = functools.wraps(constructor)(__init__)

    def startup(self) -> ProcessStartup:
        started, constructed = self._startup_cpu
        return ProcessStartup(
            kind=cls.__name__,
            before_init_cpu=started,
            init_cpu=constructed - started,
            setup_cpu=time.process_time() - constructed,
        )

    subclass = type(cls.__name__, (cls,), {"__init__": __init__, "startup": startup, "__doc__": cls.__doc__})
    subclass.__qualname__ = cls.__qualname__
    return subclass


# The pauses under way in this process (collections_paused and the worker hook's, which counts as
# one until resume_collections): the collector runs again when the last one ends, and only if it ran
# before the first began.
_pauses = 0
_collecting_before = True
_pauses_lock = threading.Lock()


def pause_collections() -> None:
    """Ray's worker set-up hook for a job's processes (workers/cluster.py `connect`): no cyclic
    collection from the process's start until its actor's constructor ends (`timed`), which
    covers the imports Ray runs to unpickle the actor's class."""
    global _pauses, _collecting_before
    with _pauses_lock:
        if _pauses == 0:
            _collecting_before = gc.isenabled()
            gc.disable()
        _pauses += 1


def resume_collections() -> None:
    """Ends one pause (`pause_collections`); none under way: nothing to do."""
    global _pauses
    with _pauses_lock:
        if _pauses == 0:
            return
        _pauses -= 1
        if _pauses == 0 and _collecting_before:
            gc.enable()


@contextmanager
def collections_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (module docstring): for the stretches of a start that
    import and build much and free little. Nests, and threads may overlap theirs."""
    pause_collections()
    try:
        yield
    finally:
        resume_collections()


@dataclass
class DriverClock:
    """The driver's CPU and wall marks: at its start (after its imports), after its inputs, and at
    the first iteration."""

    imported_cpu: float
    process_started_wall: float
    inputs_cpu: float | None = None
    read: bool = False  # by the run's first attempt: a restart's processes are not the job's start-up

    @classmethod
    def start(cls) -> DriverClock:
        return cls(imported_cpu=time.process_time(), process_started_wall=_process_start_time())

    def inputs_ready(self) -> None:
        self.inputs_cpu = time.process_time()

    def read_once(self) -> bool:
        """True the first time it is asked, False after."""
        first, self.read = not self.read, True
        return first

    def driver_startup(self) -> ProcessStartup:
        """The driver's figures, read now (at the first iteration): imports, inputs (the warm-up
        included, with the local Ray's start beside them: driver/inputs.py), then the dock and the
        workers' start as the driver waits and asks."""
        now, inputs = time.process_time(), self.inputs_cpu if self.inputs_cpu is not None else self.imported_cpu
        return ProcessStartup(
            kind="driver",
            before_init_cpu=self.imported_cpu,
            init_cpu=inputs - self.imported_cpu,
            setup_cpu=now - inputs,
        )

    def wall_since_start(self) -> float:
        return time.time() - self.process_started_wall


def startup_timing(processes: Iterable[ProcessStartup], *, wall: float) -> dict[str, Any]:
    """The first record's `timing/startup`: `wall` (seconds from the driver's start to the first
    iteration), `cpu` (every listed process's start-up CPU), and per kind the number of processes
    and each phase's CPU summed over them."""
    kinds: dict[str, dict[str, float]] = {}
    for process in processes:
        figures = kinds.setdefault(process.kind, {"processes": 0, **dict.fromkeys(PHASES, 0.0)})
        figures["processes"] += 1
        for phase, seconds in asdict(process).items():
            if phase in PHASES:
                figures[phase] += seconds
    rounded = {kind: {k: round(v, 3) for k, v in figures.items()} for kind, figures in sorted(kinds.items())}
    cpu = sum(figures[phase] for figures in kinds.values() for phase in PHASES)
    return {"wall": round(wall, 3), "cpu": round(cpu, 3), **rounded}


def startup_line(timing: dict[str, Any]) -> str:
    """`timing` (startup_timing's) in one line: the wall time, the CPU, and each kind's CPU."""
    kinds = {kind: figures for kind, figures in timing.items() if isinstance(figures, dict)}
    per_kind = ", ".join(
        f"{kind} {sum(figures[phase] for phase in PHASES):.1f}"
        + (f" ({figures['processes']:.0f} processes)" if figures["processes"] > 1 else "")
        for kind, figures in kinds.items()
    )
    return f"{timing['wall']:.1f} s to the first iteration, {timing['cpu']:.1f} CPU seconds: {per_kind}"


def _process_start_time() -> float:
    """When this process started (seconds since the epoch), from the kernel's record of it: its start
    in clock ticks after boot (/proc/self/stat) against the time since boot now. psutil's create_time
    adds the ticks to the boot time, which /proc/stat gives in whole seconds: up to 1 s off."""
    import os

    try:
        with open("/proc/self/stat") as stat:
            # the fields after the command's closing parenthesis; starttime is the 22nd field
            started_ticks = int(stat.read().rpartition(")")[2].split()[19])
    except OSError:  # not Linux
        import psutil  # type: ignore[import-untyped]  # Ray's dependency, without stubs

        return float(psutil.Process().create_time())
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age
