"""The npu twin's build lock: a build killed while it held torch's baton file no longer makes every
later load wait forever (a CI run spent its last half hour so), and two live loaders still take
turns. Cheap: nothing is compiled here."""

from __future__ import annotations

import subprocess
import sys
import threading

from rldock_e2e.doubles.npu_twin.build import sole_loader


def test_a_baton_left_by_a_killed_build_is_removed(tmp_path):
    build_dir = tmp_path / "key"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what torch's FileBaton leaves when its holder is SIGKILLed
    with sole_loader(build_dir):
        assert not (build_dir / "lock").exists()


def test_a_live_loader_holds_off_the_next_until_it_dies(tmp_path):
    build_dir = tmp_path / "key"
    build_dir.mkdir()
    holder_code = (
        "import sys, time; from pathlib import Path;"
        "from rldock_e2e.doubles.npu_twin.build import sole_loader\n"
        "with sole_loader(Path(sys.argv[1])):\n"
        "    (Path(sys.argv[1]) / 'lock').touch(); print('held', flush=True); time.sleep(600)"
    )
    holder = subprocess.Popen([sys.executable, "-c", holder_code, str(build_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def load() -> None:
            with sole_loader(build_dir):
                entered.set()

        waiter = threading.Thread(target=load, daemon=True)
        waiter.start()
        # The holder is alive and holds the lock: the waiter must still be waiting after a while.
        assert not entered.wait(timeout=1.0)
        assert (build_dir / "lock").exists()
        holder.kill()  # no cleanup runs: the kernel releases the flock, the baton file stays
        holder.wait()
        assert entered.wait(timeout=60)
        waiter.join(timeout=60)
        assert not (build_dir / "lock").exists()
    finally:
        holder.kill()
        holder.wait()
