"""Pod sandboxes for the node agent test double: Linux namespaces in place of a container runtime.

A pod gets what a container runtime and a CNI plugin would give it, without images:

- a network namespace with loopback and one interface (eth0) on the test run's bridge, an address
  from the bridge's /24 (the podIP) and a default route through it. Every pod therefore binds the
  same ports on its own address, as in a cluster (a Ray head's 6379/8265 and every node's 8080 and
  52365, `--dashboard-host=0.0.0.0` included), and the operator, on the host, reaches a head at its
  pod IP. Loopback aliases (127.0.0.x) cannot do this: Ray binds several ports on 0.0.0.0;
- a mount namespace in which the pod's volumes appear at their mountPaths, bind-mounted from
  folders the node agent filled; /tmp is the pod's own folder (Ray's session files); /dev/shm a
  tmpfs; /etc/hosts the pod's own (its name and address, as a kubelet writes it) and
  /etc/resolv.conf naming the cluster DNS double (cluster_dns.py), which answers Service names;
  /etc/profile.d the "image"'s profile script (KubeRay runs `bash -lc`, and a login shell resets
  PATH, so images put their PATH there). Nothing in a path is rewritten: the operator's
  `/etc/rldock/job.yaml` and `/checkpoints/...` are the paths the processes open;
- a UTS namespace (hostname = pod name);
- each container its own PID namespace, entered by `unshare --fork --kill-child`: when the
  container's main process ends, or the container is killed, the kernel kills everything it
  started (a Ray raylet, its workers, a job driver), so no process outlives its pod.

Every process is a processes.ManagedProcess (own process group, SIGKILLed by the kernel when the
test run dies, killed at exit). Needs root: `sandbox_unavailable()` says why not.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rldock_e2e.controlplane.processes import ManagedProcess, pid_alive
from rldock_e2e.doubles import mountpoints

log = logging.getLogger(__name__)

_BRIDGE_PREFIX = "rle2e"  # + the owning test run's pid in hex: stale bridges of dead runs are removed
_READY_LINE = "rldock-sandbox-ready"


def sandbox_unavailable() -> str | None:
    """Why pods cannot be sandboxed on this machine, or None when they can."""
    if os.geteuid() != 0:
        return "the node agent double needs root (network and mount namespaces, a bridge)"
    for tool in ("unshare", "nsenter", "ip", "mount"):
        if shutil.which(tool) is None:
            return f"the node agent double needs `{tool}` (util-linux / iproute2)"
    probe = subprocess.run(
        ["unshare", "--net", "--mount", "--uts", "--pid", "--fork", "true"], capture_output=True, text=True
    )
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip()}"
    return None


def _ip(*args: str, netns_pid: int | None = None) -> None:
    argv = ["ip", *args] if netns_pid is None else ["nsenter", f"--target={netns_pid}", "--net", "ip", *args]
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


class PodNetwork:
    """A bridge with a /24 of pod addresses; the host takes .1, so it reaches every pod directly.

    Pods reach each other through the bridge; nothing is routed elsewhere (no NAT, no forwarding
    sysctl touched), and the host's own loopback (the API server) is out of a pod's reach, as a
    cluster's control plane is out of reach of pods without a Service.
    """

    def __init__(self) -> None:
        self.bridge = f"{_BRIDGE_PREFIX}{os.getpid():x}"
        self.subnet: ipaddress.IPv4Network | None = None
        self._free: list[str] = []
        self._lock = threading.Lock()
        self._veths = 0

    @property
    def gateway(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def create(self) -> None:
        _remove_stale_bridges()
        self.subnet = _free_subnet()
        _ip("link", "add", "name", self.bridge, "type", "bridge")
        # A MAC of its own: a bridge without one takes the lowest of its ports', so deleting that pod's
        # veth changed the gateway's MAC under the other pods, whose cached ARP entry then pointed
        # nowhere: they lost the API server and DNS for ~30 s (an operator lost its leader Lease).
        mac = "02:00:" + ":".join(f"{byte:02x}" for byte in self.subnet.network_address.packed)  # local, per subnet
        _ip("link", "set", self.bridge, "address", mac)
        _ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._free = [str(host) for host in list(self.subnet.hosts())[1:]]
        log.info("pod network %s on bridge %s", self.subnet, self.bridge)

    def destroy(self) -> None:
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def allocate(self) -> str:
        with self._lock:
            if not self._free:
                raise RuntimeError(f"pod network {self.subnet} has no free address")
            return self._free.pop(0)

    def release(self, address: str) -> None:
        with self._lock:
            self._free.append(address)  # reused last: a stale address is not handed out at once

    def attach(self, pid: int, address: str) -> None:
        """Give the network namespace of `pid` an eth0 with `address` on the bridge."""
        assert self.subnet is not None
        with self._lock:
            self._veths += 1
            tag = f"{os.getpid():x}{self._veths:x}"
        host_end, pod_end = f"vh{tag}"[:15], f"vp{tag}"[:15]
        _ip("link", "add", host_end, "type", "veth", "peer", "name", pod_end)
        _ip("link", "set", pod_end, "netns", str(pid))
        _ip("link", "set", host_end, "master", self.bridge, "up")
        _ip("link", "set", "lo", "up", netns_pid=pid)
        _ip("link", "set", pod_end, "name", "eth0", netns_pid=pid)
        _ip("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0", netns_pid=pid)
        _ip("link", "set", "eth0", "up", netns_pid=pid)
        _ip("route", "add", "default", "via", self.gateway, netns_pid=pid)
        # The host end goes away with the namespace (when the pod's last process ends).


def add_address(interface: str, address: str) -> None:
    """Put `address`/32 on `interface` (so the host answers it: a Service's ClusterIP)."""
    _ip("addr", "add", f"{address}/32", "dev", interface)


def _remove_stale_bridges() -> None:
    links = json.loads(
        subprocess.run(["ip", "-j", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout or "[]"
    )
    for link in links:
        match = re.fullmatch(rf"{_BRIDGE_PREFIX}([0-9a-f]+)", link.get("ifname", ""))
        if match and not pid_alive(int(match.group(1), 16)):
            subprocess.run(["ip", "link", "del", link["ifname"]], capture_output=True)


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.244.N.0/24 that no route of this machine touches (other test runs use some)."""
    routes = json.loads(subprocess.run(["ip", "-j", "route", "show"], capture_output=True, text=True).stdout or "[]")
    used = []
    for route in routes:
        dst = route.get("dst", "")
        if dst and dst != "default":
            used.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    for third in range(1, 255):
        candidate = ipaddress.ip_network(f"10.244.{third}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise RuntimeError("no free 10.244.N.0/24 for the pod network")


@dataclass(frozen=True)
class Mount:
    """`target` (a path in the pod) shows `source` (a host folder or file), or a fresh tmpfs."""

    target: str
    source: Path | None = None
    read_only: bool = False
    tmpfs_size: str | None = None  # e.g. "64m"; None: the kernel's default (half the memory)


def _tmpfs_mount(mount: Mount, target: str) -> str:
    size = f",size={mount.tmpfs_size}" if mount.tmpfs_size else ""
    return f"mount -t tmpfs -o mode=1777{size} tmpfs {target}"


class PodSandbox:
    """The namespaces of one pod, held by a `sleep` (the pause container), and its containers."""

    def __init__(self, *, name: str, root: Path, mounts: Sequence[Mount], network: PodNetwork | None) -> None:
        self.name = name
        self.root = root
        self.mounts = list(mounts)
        self.network = network  # None: the host's network (hostNetwork: true)
        self.ip: str | None = None
        self.uts_inode: int | None = None  # names the pod's processes: all of them share it
        self._pause: ManagedProcess | None = None

    # ----- lifecycle ------------------------------------------------------------------------------
    def start(self, *, timeout: float = 15.0) -> None:
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        unshare = ["unshare", "--mount", "--uts", "--propagation", "private"]
        if self.network is not None:
            unshare.append("--net")
        self._pause = ManagedProcess(
            f"pod {self.name} (pause)",
            [*unshare, "--", "/bin/sh", "-c", self._setup_script()],
            log_path=self.root / "logs" / "sandbox.log",
            env=_PLAIN_ENV,
            cwd=Path("/"),
        )
        deadline = time.monotonic() + timeout
        while _READY_LINE not in self._pause.log_tail(5):
            if self._pause.poll() is not None or time.monotonic() > deadline:
                tail = self._pause.log_tail(20)
                self.stop(grace=0)
                raise RuntimeError(f"sandbox of pod {self.name} did not start:\n{tail}")
            time.sleep(0.02)
        self.uts_inode = os.stat(f"/proc/{self._pause.pid}/ns/uts").st_ino
        if self.network is not None:
            self.ip = self.network.allocate()
            self.network.attach(self._pause.pid, self.ip)

    def _setup_script(self) -> str:
        """Runs inside the new namespaces: hostname, mounts (parents first, /tmp last: its source
        may lie under the host's /tmp), then the pause.

        A mount inside /tmp (a checkout under the host's /tmp) goes into the folder that becomes
        /tmp first, while its own source is still visible, and that folder is then bound to /tmp
        recursively; a tmpfs /tmp (an emptyDir) is mounted on a folder of the pod's root for this."""
        lines = ["set -e", f"hostname {shlex.quote(self.name[:63])}"]
        tmp = next((m for m in self.mounts if m.target == "/tmp"), None)
        tmp_folder = tmp.source if tmp is not None else None
        if tmp is not None and tmp.source is None:
            tmp_folder = self.root / "tmp-volume"
            lines.append(f"mkdir -p {shlex.quote(str(tmp_folder))}")
            lines.append(_tmpfs_mount(tmp, str(tmp_folder)))
        ordered = sorted(self.mounts, key=lambda m: (m.target == "/tmp", m.target.count("/"), m.target))
        for mount in ordered:
            target = mount.target
            if tmp_folder is not None and mount is not tmp and Path(target).is_relative_to("/tmp"):
                target = str(tmp_folder / Path(target).relative_to("/tmp"))
                lines.append(f"mkdir -p {shlex.quote(target)}")
            target = shlex.quote(target)
            if mount is tmp:
                lines.append(f"mount --rbind {shlex.quote(str(tmp_folder))} {target}")
            elif mount.source is None:
                lines.append(_tmpfs_mount(mount, target))
            else:
                lines.append(f"mount --bind {shlex.quote(str(mount.source))} {target}")
                if mount.read_only:
                    lines.append(f"mount -o remount,bind,ro {target}")
        lines += [f"echo {_READY_LINE}", "exec sleep infinity"]
        return "\n".join(lines)

    def prepare_mountpoints(self) -> None:
        """Create the mount targets that do not exist on the host (a mount needs one); they stay
        empty there, and mountpoints.release() removes them once no agent uses them."""
        directories = []
        for mount in self.mounts:
            target = Path(mount.target)
            if mount.source is not None and mount.source.is_file():
                if not target.exists():  # a file volume (subPath) at a new path: rare, left behind
                    mountpoints.claim([str(target.parent)])
                    target.touch()
            else:
                directories.append(mount.target)
        mountpoints.claim(directories)

    def exec(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        working_dir: str = "/",
        own_pid_namespace: bool = True,
    ) -> ManagedProcess:
        """Start `argv` in the pod: its network, mounts and hostname; with `own_pid_namespace` in a
        PID namespace of its own (a container), else in the host's (a probe)."""
        assert self._pause is not None, "start() first"
        enter = self._enter(self._pause.pid, working_dir)
        if own_pid_namespace:
            enter += ["--", "unshare", "--pid", "--mount", "--fork", "--kill-child", "--mount-proc"]
        return self._start(name, enter, argv, env)

    def exec_in(self, name: str, target: int, argv: Sequence[str], *, env: Mapping[str, str]) -> ManagedProcess:
        """Start `argv` in the running container whose PID 1 is host pid `target`: its PID and mount
        namespaces (its /proc: the processes it sees are the container's own), the pod's network and
        hostname, as `kubectl exec` and a kubelet's exec hooks do."""
        return self._start(name, [*self._enter(target, "/"), "--pid"], argv, env)

    def _enter(self, target: int, working_dir: str) -> list[str]:
        """nsenter into `target`'s mounts and hostname, and the pod's network where it has its own."""
        enter = ["nsenter", f"--target={target}", "--mount", "--uts", f"--wd={working_dir}"]
        return [*enter, "--net"] if self.network is not None else enter

    def _start(self, name: str, enter: list[str], argv: Sequence[str], env: Mapping[str, str]) -> ManagedProcess:
        return ManagedProcess(
            f"pod {self.name}: {name}",
            [*enter, "--", *argv],
            log_path=self.root / "logs" / f"{name}.log",
            env=dict(env),
            cwd=Path("/"),
        )

    def stop(self, *, grace: float, processes: Sequence[ManagedProcess] = ()) -> None:
        """SIGTERM `processes`, SIGKILL what is left after `grace` s, then end the namespaces."""
        stop_processes(processes, grace=grace)
        if self._pause is not None:
            self._pause.stop(timeout=1)
            self._pause = None
        # Containers die with their PID namespaces; anything else that entered the pod (a probe
        # cut off mid-run) is killed here, so nothing of the pod is left.
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.ip is not None and self.network is not None:
            self.network.release(self.ip)

    def pids(self) -> list[int]:
        """Every live process of this pod (host pids), found by its UTS namespace."""
        return pids_in_namespace("uts", self.uts_inode) if self.uts_inode is not None else []


def stop_processes(processes: Sequence[ManagedProcess], *, grace: float) -> None:
    """SIGTERM every process group at once, wait up to `grace` s for all, then SIGKILL the rest."""
    live = [p for p in processes if p.poll() is None]
    for process in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    # A container's first process ignores SIGTERM unless it handles it (it is a PID namespace's
    # init), as in any container runtime: what is left is killed now.
    for process in live:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    for process in processes:
        process.stop(timeout=5)


def pids_in_namespace(kind: str, inode: int) -> list[int]:
    """Host pids of the live processes whose `kind` namespace ("uts", "net", ...) has this inode."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry / "ns" / kind).st_ino == inode and pid_alive(int(entry.name)):
                found.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


# The sandbox's own helpers (sh, mount, sleep) need no more than this.
_PLAIN_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
