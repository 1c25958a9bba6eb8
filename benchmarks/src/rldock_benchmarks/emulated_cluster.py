"""An emulated multi-node Ray cluster on one machine: one network namespace per node.

Node k runs in namespace `<prefix>-n<k>` with address 10.<net>.k+10/24 on a veth pair whose other
end sits on a bridge `<prefix>-br` (no address on the host side: only addresses inside the
namespaces and loopback are used). `set_cap` puts a tc token-bucket filter on both ends of every
node's veth, so each node can send and receive at most that many bytes per second, like a NIC.
Everything is created by `up` and removed by `down`, by exact name.

If the kernel refuses a step (no netns, no veth, no tc), `NetworkRefused` says which step and the
caller falls back to loopback, reporting the cap as absent. Ray nodes are `ray start --block`
processes in their own sessions; `stop` ends exactly those sessions, never other Ray processes on
the machine. Needs root.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

GCS_PORT = 6379
NODE_RESOURCE = "rldock_bench_node_{}"  # a logical resource naming each emulated node


class NetworkRefused(RuntimeError):
    """The kernel (or a missing tool) refused one step of building the emulated network."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"{step}: {detail}")
        self.step = step
        self.detail = detail


@dataclass
class EmulatedNetwork:
    """S namespaces on a bridge, each behind a veth pair that tc can cap."""

    num_nodes: int
    prefix: str = "rldk"
    net: int = 231  # second octet of 10.x.0.0/24
    created: list[tuple[str, str]] = field(default_factory=list)  # ("netns"|"link", name), in order
    cap_mbytes_per_s: float | None = None

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def node_ip(self, node: int) -> str:
        return f"10.{self.net}.0.{node + 10}"

    def host_veth(self, node: int) -> str:
        return f"{self.prefix}-v{node}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}-br"

    def up(self) -> None:
        """Create the bridge, the namespaces and the veth pairs; NetworkRefused names a refused step."""
        self.down()  # leftovers of a run that was killed
        self._step("create bridge", ["ip", "link", "add", self.bridge, "type", "bridge"], ("link", self.bridge))
        self._step("bring the bridge up", ["ip", "link", "set", self.bridge, "up"])
        for k in range(self.num_nodes):
            ns, veth = self.namespace(k), self.host_veth(k)
            self._step(f"create namespace {ns}", ["ip", "netns", "add", ns], ("netns", ns))
            self._step(
                f"create veth {veth}",
                ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
                ("link", veth),
            )
            self._step(f"attach {veth} to the bridge", ["ip", "link", "set", veth, "master", self.bridge, "up"])
            self._step(f"address node {k}", ["ip", "-n", ns, "addr", "add", f"{self.node_ip(k)}/24", "dev", "eth0"])
            self._step(f"bring node {k} up", ["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._step(f"bring node {k} loopback up", ["ip", "-n", ns, "link", "set", "lo", "up"])

    def set_cap(self, mbytes_per_s: float | None) -> None:
        """Cap every node's link at `mbytes_per_s` MB/s each way (None: remove the caps)."""
        for k in range(self.num_nodes):
            for where in (["tc"], ["ip", "netns", "exec", self.namespace(k), "tc"]):
                dev = self.host_veth(k) if len(where) == 1 else "eth0"
                subprocess.run([*where, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                if mbytes_per_s is not None:
                    mbit = int(mbytes_per_s * 8)
                    # A token bucket: rate in Mbit/s, a 4 MB burst (a few ms of traffic), 100 ms queue.
                    self._step(
                        f"tc cap on {dev} of node {k}",
                        [
                            *where,
                            "qdisc",
                            "add",
                            "dev",
                            dev,
                            "root",
                            "tbf",
                            "rate",
                            f"{mbit}mbit",
                            "burst",
                            "4mb",
                            "latency",
                            "100ms",
                        ],
                    )
        self.cap_mbytes_per_s = mbytes_per_s

    def down(self) -> None:
        """Remove our namespaces and links (by exact name; missing ones are fine)."""
        for k in range(self.num_nodes):
            subprocess.run(["ip", "link", "del", self.host_veth(k)], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.namespace(k)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.created.clear()

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(node)]

    def _step(self, step: str, cmd: list[str], created: tuple[str, str] | None = None) -> None:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as err:
            raise NetworkRefused(step, f"{cmd[0]} not found ({err})") from None
        if done.returncode != 0:
            raise NetworkRefused(step, f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
        if created:
            self.created.append(created)


@dataclass
class RayNodes:
    """`ray start --block` per emulated node, each in its own session so `stop` can end exactly it."""

    temp_dir: str = "/tmp/rldock-bench-ray"
    object_store_bytes: int = 2 * 1024**3
    num_cpus: int = 8
    processes: list[subprocess.Popen] = field(default_factory=list)

    def start(self, network: EmulatedNetwork) -> str:
        """Start a head in node 0's namespace and one worker node per other namespace; the GCS address."""
        head = f"{network.node_ip(0)}:{GCS_PORT}"
        for k in range(network.num_nodes):
            role = (
                ["--head", f"--port={GCS_PORT}", f"--temp-dir={self.temp_dir}", "--include-dashboard=false"]
                if k == 0
                else [f"--address={head}"]
            )
            cmd = [
                *network.exec_prefix(k),
                sys.executable,
                "-m",
                "ray.scripts.scripts",
                "start",
                *role,
                "--block",
                f"--node-ip-address={network.node_ip(k)}",
                f"--num-cpus={self.num_cpus}",
                f"--object-store-memory={self.object_store_bytes}",
                "--disable-usage-stats",
                f"--resources={json.dumps({NODE_RESOURCE.format(k): 1})}",
            ]
            log_path = Path(self.temp_dir).parent / f"rldock-bench-node{k}.log"
            for attempt in range(1, _START_ATTEMPTS + 1):
                with log_path.open("w") as log:
                    self.processes.append(
                        subprocess.Popen(
                            cmd, stdout=log, stderr=subprocess.STDOUT, env=ray_env(), start_new_session=True
                        )
                    )
                # One node at a time: on a small machine, nodes that start together time out.
                try:
                    _wait_for_start(self.processes[-1], log_path, node=k)
                    break
                except NodeExited:
                    # `ray start` gives a raylet 30 s to register, which a loaded machine can miss.
                    if attempt == _START_ATTEMPTS:
                        raise
                    failed = self.processes.pop()
                    _end_sessions([failed.pid])
                    failed.wait(timeout=5)
                    logger.warning(
                        "Ray node %d did not come up (attempt %d of %d); starting it again", k, attempt, _START_ATTEMPTS
                    )
                    time.sleep(5)
        return head

    def stop(self) -> None:
        """End every process of our sessions: SIGTERM, then SIGKILL to whatever is left."""
        _end_sessions([p.pid for p in self.processes])
        for p in self.processes:
            p.wait(timeout=5)
        self.processes.clear()


_START_ATTEMPTS = 3


class NodeExited(RuntimeError):
    """A `ray start` process ended before its node was up."""


def _end_sessions(sessions: list[int]) -> None:
    """SIGTERM, then SIGKILL, every process of the sessions led by `sessions` (our own `ray start`s)."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in _session_members(sessions):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while _session_members(sessions) and time.monotonic() < deadline:
            time.sleep(0.2)


def _wait_for_start(process: subprocess.Popen, log_path: Path, *, node: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "Ray runtime started" in log_path.read_text():
            return
        if process.poll() is not None:
            raise NodeExited(f"Ray node {node} exited during start-up; see {log_path}")
        time.sleep(0.5)
    raise RuntimeError(f"Ray node {node} did not start within {timeout_s:g}s; see {log_path}")


def ray_env() -> dict[str, str]:
    """Environment of every emulated-cluster process: no token auth, no usage reporting."""
    return {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONWARNINGS": "ignore",
    }


def _session_members(session_ids: list[int]) -> list[int]:
    """PIDs whose session is one of `session_ids` (the Popen leaders we started with setsid)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) in session_ids:  # field 6 of /proc/pid/stat: session id
            members.append(int(entry.name))
    return members
