"""Build the twin's C++ extension once into ${RLDOCK_CACHE:-~/.cache/rldock}/npu-twin/<key>.

The key hashes the source and the torch version, so a new torch or an edited source builds afresh
and an unchanged pair loads the cached library (ninja sees nothing to do). A cold build compiles
two files against torch's headers: about 30 s of CPU time (1.5-2 min on the loaded 2-core machine).

torch guards a build with a file that exists while a process builds (`<key>/lock`, its FileBaton)
and waits, without limit, for that file to go. A process killed while it held it (a test run
stopped at its timeout, a SIGKILLed test) leaves the file, and every later load waited forever: a
CI run spent its last half hour so. Loads here first take an flock on `<key>.flock`, which the
kernel releases when its holder dies; whoever holds it is the only loader on the machine, so a
baton file it finds is stale and is removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("npu_twin.cpp", "hccl_twin.cpp")]
EXTENSION_NAME = "rldock_npu_twin"


class TwinUnavailable(RuntimeError):
    """The twin cannot be built here (no C++ compiler or ninja); tests skip with this reason."""


def cache_dir() -> Path:
    text = b"".join(source.read_bytes() for source in SOURCES)
    key = hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:16]
    root = Path(os.environ.get("RLDOCK_CACHE", Path.home() / ".cache" / "rldock"))
    return root / "npu-twin" / key


@contextmanager
def sole_loader(build_dir: Path) -> Iterator[None]:
    """Hold the machine-wide loader lock of `build_dir`, with torch's stale baton removed."""
    with open(build_dir.with_name(build_dir.name + ".flock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)  # released by the kernel if this process dies
        baton = build_dir / "lock"  # torch.utils.cpp_extension's FileBaton
        if baton.exists():
            logger.warning("removing %s, left by a build that was killed", baton)
            baton.unlink()
        try:
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def load_extension() -> ModuleType:
    """The compiled extension, built first when the cache lacks it."""
    from torch.utils.cpp_extension import load

    # The venv's own ninja (requirements/cpu.lock) when the venv is not activated, as under `make
    # test`; PATH is restored afterwards so later subprocesses see the caller's.
    path = os.environ.get("PATH", "")
    search = os.pathsep.join([str(Path(sys.executable).parent), path])
    compiler = os.environ.get("CXX", "c++")
    missing = [tool for tool in (compiler, "ninja") if shutil.which(tool, path=search) is None]
    python_header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_header.exists():
        missing.append(f"Python's C headers ({python_header})")
    if missing:
        raise TwinUnavailable(
            f"the npu twin cannot build its C++ extension here: {', '.join(missing)} missing "
            "(apt-get install g++ ninja-build python3-dev)"
        )
    build_dir = cache_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    logger.info("loading the npu twin from %s (built there first if missing)", build_dir)
    os.environ["PATH"] = search
    try:
        with sole_loader(build_dir):
            return load(
                name=EXTENSION_NAME,
                sources=[str(source) for source in SOURCES],
                build_directory=str(build_dir),
                extra_cflags=["-O1"],
                verbose=False,
            )
    finally:
        os.environ["PATH"] = path
