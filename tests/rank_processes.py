"""The rank tests' one way to start their gloo ranks: `spawn(fn, args, nprocs)`, torch.multiprocessing's
`spawn` with its processes forked from a forkserver, one per pytest process, that has imported what
the ranks import (torch, transformers' model classes, the runtime's training modules, every rank test
module) once, instead of fresh interpreters that each import them again: 3.8 CPU seconds per rank of
test_hybrid_sharding_ranks on the 2-core machine, 8 ranks a test. Measured there, quiet: that file's
four tests 27.3 s spawned, 7.8 s forked; all of tests/ranks (55 tests) 51 s forked.

What a forked rank shares with the forkserver is imported modules only: the forkserver never runs a
torch op (an OpenMP pool forked into a child would hang it), and each rank joins its gloo group and
sets its threads itself. The ranks get the test process's sys.path and working directory at each
spawn, as spawned ones do, but the environment the forkserver started with (the rank tests set no
variable). Imported by basename, like tests/jobs.py.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

# Imported by the forkserver when it starts (a module that fails to import is skipped, and then
# imported by each rank that needs it, as before).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "rldock.runtime.device",
    "rldock.runtime.training.fsdp",
    "rldock.runtime.training.ddp",
    "rldock.runtime.training.strategies",
    "rldock.runtime.engines.policy",
    *sorted(path.stem for path in (Path(__file__).parent / "ranks").glob("test_*_ranks.py")),
]


def spawn(fn: Callable[..., Any], args: tuple = (), nprocs: int = 1) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)` (it waits for the ranks and raises a rank's
    error) from the preloaded forkserver (module docstring)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
