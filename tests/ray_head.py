"""A real Ray head for tests: `ray start --head --block` in its own process group, on free ports and a
private temp dir, with token authentication as the operator configures every Ray pod (RAY_AUTH_MODE=token,
RAY_AUTH_TOKEN): a driver joins with RAY_ADDRESS as 127.0.0.1:port, which Ray resolves to this
machine's address, so the head listens on every interface, and the token is what keeps others out.
Imported by basename, like jobs.

It is stopped by killing its group and then every process whose command line names its temp dir
(Ray starts its raylet and workers in sessions of their own): never `ray stop`, which would end
every Ray process on the machine. The temp dir also keeps it out of a bare `ray.init()` elsewhere on
the machine, which looks for `ray start` clusters only under /tmp/ray.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import psutil

from rldock_e2e.controlplane import pid_alive, wait_for
from rldock_e2e.controlplane.processes import ManagedProcess, free_ports


@dataclass(frozen=True)
class RayHead:
    address: str  # host:port of its GCS, what RAY_ADDRESS holds
    dashboard_url: str | None  # the Jobs API, when started with the dashboard
    token: str
    temp_dir: Path
    process: ManagedProcess

    @property
    def client_environment(self) -> dict[str, str]:
        """What a driver needs in its environment to join this head."""
        return {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def worker_processes(self, *titles: str) -> list[psutil.Process]:
        """The live processes this head's raylet started whose title (`ray::<actor class>`) starts
        with one of `titles`: a joined job's workers are the raylet's children, not the driver's."""
        return [
            child
            for process in _processes_naming(self.temp_dir)
            for child in process.children(recursive=True)
            if " ".join(child.cmdline()).startswith(titles)
        ]


@contextmanager
def ray_head(
    *, num_cpus: int, resources: Mapping[str, float] | None = None, dashboard: bool = False
) -> Iterator[RayHead]:
    ray = Path(sys.executable).with_name("ray")
    # ray[default] is pinned in every lock: a missing CLI is a broken install, not a reason to skip the
    # whole integration tier, which this head serves.
    assert ray.exists(), f"no ray CLI beside {sys.executable}: run `make setup`"
    token = secrets.token_hex(32)
    gcs, dashboard_port, manager, objects, client, agent_http, agent_grpc, runtime_env, metrics = free_ports(9)
    temp = Path(tempfile.mkdtemp(prefix="rldock-ray-", dir="/tmp"))  # short: Ray's unix sockets live here
    argv = [
        str(ray),
        "start",
        "--head",
        "--block",
        f"--port={gcs}",
        f"--include-dashboard={str(dashboard).lower()}",
        *(["--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}"] if dashboard else []),
        f"--node-manager-port={manager}",
        f"--object-manager-port={objects}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
        f"--num-cpus={num_cpus}",
        *([f"--resources={json.dumps(dict(resources))}"] if resources else []),
        f"--temp-dir={temp}",
        "--disable-usage-stats",
    ]
    head = RayHead(
        address=f"127.0.0.1:{gcs}",
        dashboard_url=f"http://127.0.0.1:{dashboard_port}" if dashboard else None,
        token=token,
        temp_dir=temp,
        process=ManagedProcess(
            "ray-head",
            argv,
            log_path=temp / "head.log",
            env={
                **{key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"},
                "RAY_AUTH_MODE": "token",
                "RAY_AUTH_TOKEN": token,
                "RAY_USAGE_STATS_ENABLED": "0",
            },
            cwd=temp,
        ),
    )
    try:
        # `ray start --block` prints this once the head's GCS, raylet and (if asked) dashboard are up.
        wait_for("the Ray head to start", lambda: _started(head), timeout=180, interval=0.5)
        yield head
    finally:
        head.process.stop(timeout=3)  # `ray start --block` may sit on SIGTERM; then the group is killed
        assert not pid_alive(head.process.pid)
        _kill_processes_naming(temp)
        shutil.rmtree(temp, ignore_errors=True)


def _started(head: RayHead) -> bool:
    if head.process.poll() is not None:
        raise AssertionError(f"ray start exited:\n{head.process.log_tail()}")
    return "will now block forever" in head.process.log_path.read_text(errors="replace")


def _processes_naming(temp: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if str(temp) in " ".join(p.info["cmdline"] or ())]


def _kill_processes_naming(temp: Path) -> None:
    """SIGKILL what the head started outside its group (raylet, GCS, workers): each names `temp`."""
    mine = _processes_naming(temp)
    for process in mine:
        with suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
    psutil.wait_procs(mine, timeout=10)
