"""Running twin ranks as processes (imported by basename, by the tests and by the rank scripts): the
test starts WORLD copies of a rank script and waits for them; each joins the group through the
product's init_process_group on its own npu twin device."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from rldock.runtime.device import DeviceInfo, detect_device
from rldock.runtime.engines.process_group import Rendezvous, init_process_group
from rldock_e2e.doubles.npu_twin import activate


def run_ranks(script: Path, world_size: int, out: Path) -> None:
    """Run `python script RANK WORLD_SIZE PORT OUT` for every rank and assert each exits 0.

    This process holds the group's store on a port the OS picked and keeps it bound while the ranks
    connect (a port probed free and bound later by a rank could be taken in between)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=timedelta(seconds=300), wait_for_workers=False
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # the ranks import what this process does
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world_size), str(store.port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    for rank in ranks:
        output, _ = rank.communicate(timeout=300)
        assert rank.returncode == 0, output[-4000:]


def join_group(rank: int, world_size: int, port: int) -> DeviceInfo:
    """In a rank script: the twin on, one thread, this rank's npu:RANK in the group whose store the
    test process holds (every rank, rank 0 too, connects to it as a client)."""
    activate()
    torch.set_num_threads(1)
    device = detect_device("npu", index=rank)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=120))
    init_process_group(
        device,
        rank=rank,
        world_size=world_size,
        rendezvous=Rendezvous(address="127.0.0.1", port=port),
        store=store,
        timeout_s=120,
    )
    return device


def run_rank_script(main: Callable[[int, int, int, Path], None]) -> NoReturn:
    """A rank script's `__main__`: `main(RANK, WORLD_SIZE, PORT, OUT)` from the command line, then leave
    without interpreter finalization, as twin_ddp_rank.py explains (gloo's run-loop thread releasing
    the last collective's tensor after finalization began aborts the rank). The results are on disk;
    an exception in `main` still exits non-zero."""
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
