"""Kind-style nodes for the e2e control plane: one privileged podman container per node, each
with its own containerd and a real kubelet (built from the control plane's source), joined to a
ControlPlane started with `node_address=network.gateway`.

    with NodeNetwork.create(index) as network, \\
         ControlPlane(node_address=network.gateway) as cp, \\
         KindNodes(cp, network, images=[archive]) as nodes:
        nodes.add("npu-0", devices=8)
        nodes.wait_ready()

Everything built (node image, pause image) is cached by podman and in ~/.cache/rldock; what
this machine cannot do is reported by `unavailable_reason()` so tests skip with it. Test
tooling only: nothing in `rldock` imports it.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..controlplane import ControlPlane, credentials
from ..controlplane.cluster import wait_for

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[3]
NODE_FILES = ("node.Dockerfile", "node-entrypoint.sh", "containerd.toml", "device_plugin.py")
PAUSE_IMAGE = "localhost/rldock/pause:1.20.2"
DEVICE_RESOURCE = "huawei.com/Ascend910"
# Node containers sit on 10.90.<k>.0/24 (the host is .1), pods of node i on 10.245.<i>.0/24.
NODE_SUBNET_PREFIX = "10.90"
POD_SUBNET_PREFIX = "10.245"
# Where every node mounts KindNodes.shared_storage (hostPath volumes under it are shared).
SHARED_STORAGE_PATH = "/mnt/rldock-shared"


def cache_root() -> Path:
    return Path(os.environ.get("RLDOCK_CACHE", Path.home() / ".cache" / "rldock"))


@functools.cache
def _containers_conf_path() -> str:
    """images/containers-conf.sh, once per process: rlimits this machine allows and OCI runtime runc."""
    result = subprocess.run(
        [str(REPO / "images" / "containers-conf.sh")],
        check=True,
        text=True,
        capture_output=True,
        env={**os.environ, "RLDOCK_CACHE": str(cache_root())},
    )
    return result.stdout.strip().splitlines()[-1]


def containers_conf() -> dict[str, str]:
    """Environment for every podman call: CONTAINERS_CONF with rlimits capped to what runc may
    set here and `[engine] runtime = "runc"` (crun, podman's first choice, refuses this machine's
    hybrid cgroups). The same file images/build.sh gives its builds."""
    return {**os.environ, "CONTAINERS_CONF": _containers_conf_path()}


def podman(*args: str, check: bool = True, capture: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], check=check, text=True, env=containers_conf(), capture_output=capture)


# What the host needs (Debian bookworm); containerd, its own runc and the CNI plugins go into the
# node image. runc for podman itself: podman pulls in crun, which fails on hybrid cgroups, and
# whether runc is already here depends on the machine's history (containers_conf selects it).
HOST_PACKAGES = ("podman", "buildah", "runc", "debootstrap")


def unavailable_reason() -> str | None:
    """Why kind-style nodes cannot run on this machine, or None when they can. Installs the
    host's packages with apt-get when they are missing (about 10 s)."""
    if os.geteuid() != 0:
        return "kind-style nodes need root (privileged podman containers, cgroups)"
    missing = [p for p in HOST_PACKAGES if shutil.which(p) is None]
    if not missing:
        return None
    if shutil.which("apt-get") is None:
        return f"missing {', '.join(missing)} and no apt-get to install them (a Debian bookworm machine is needed)"
    # Waits for another apt-get's lock (a build beside it may be installing) instead of failing.
    result = subprocess.run(
        ["apt-get", "install", "-y", "-q", "-o", "DPkg::Lock::Timeout=600", *HOST_PACKAGES],
        check=False,
        text=True,
        capture_output=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )
    if result.returncode != 0:
        return f"apt-get install {' '.join(HOST_PACKAGES)} failed: {result.stderr.strip()[-500:]}"
    _containers_conf_path.cache_clear()  # written again, now that runc is here
    return None


def build_node_binaries() -> Path:
    """The kubelet and pause binaries (nodes/build_kubelet.sh; ~8 min cold, then cached)."""
    result = subprocess.run([str(HERE / "build_kubelet.sh")], check=False, text=True, capture_output=True)
    if result.returncode == 2:
        raise NodesUnavailable(result.stderr.strip().splitlines()[-1])
    if result.returncode != 0:
        raise RuntimeError(f"build_kubelet.sh failed:\n{result.stderr[-3000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def local_base_image() -> str:
    """images/local-base.sh: Debian bookworm + python3 from debootstrap (cached)."""
    result = subprocess.run(
        [str(REPO / "images" / "local-base.sh")],
        check=False,
        text=True,
        capture_output=True,
        env={**containers_conf(), "ENGINE": "podman"},
    )
    if result.returncode == 2:
        raise NodesUnavailable(result.stderr.strip().splitlines()[-1])
    if result.returncode != 0:
        raise RuntimeError(f"images/local-base.sh failed:\n{result.stderr[-3000:]}")
    return result.stdout.strip().splitlines()[-1]


class NodesUnavailable(RuntimeError):
    """This machine cannot run kind-style nodes; the message says why (tests skip with it)."""


def _digest(paths: list[Path], extra: str = "") -> str:
    digest = hashlib.sha256(extra.encode())
    for path in paths:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def build_node_image(binaries: Path, base_image: str) -> str:
    """localhost/rldock/node:<hash of its inputs>, built once."""
    inputs = [HERE / name for name in NODE_FILES] + [binaries / "kubelet", binaries / "api.proto"]
    image = f"localhost/rldock/node:{_digest(inputs, base_image)}"
    if podman("image", "exists", image, check=False).returncode == 0:
        return image
    with tempfile.TemporaryDirectory(prefix="rldock-node-image-") as context:
        for path in inputs:
            shutil.copy2(path, context)
        log.info("building %s", image)
        _build(context, "node.Dockerfile", image, base_image)
    return image


def pause_archive(binaries: Path) -> Path:
    """The pause image (pause.c from the Kubernetes source, static) as an OCI archive."""
    archive = cache_root() / "images" / f"pause-{_digest([binaries / 'pause'])}.tar"
    if archive.exists():
        return archive
    with tempfile.TemporaryDirectory(prefix="rldock-pause-image-") as context:
        shutil.copy2(binaries / "pause", context)
        Path(context, "Dockerfile").write_text('FROM scratch\nCOPY pause /pause\nENTRYPOINT ["/pause"]\n')
        _build(context, "Dockerfile", PAUSE_IMAGE, None)
    partial = archive.with_suffix(".part")
    podman("save", "--format", "oci-archive", "-o", str(partial), PAUSE_IMAGE)
    partial.rename(archive)
    return archive


def _build(context: str, dockerfile: str, tag: str, base_image: str | None) -> None:
    # runc named here too (as images/build.sh does), so that RUN steps use it whatever podman reads.
    args = [
        "nice",
        "-n",
        "19",
        "podman",
        "build",
        "--runtime",
        "runc",
        "--layers",
        "-f",
        str(Path(context, dockerfile)),
        "-t",
        tag,
    ]
    if base_image:
        args += ["--build-arg", f"BASE_IMAGE={base_image}"]
    result = subprocess.run([*args, context], check=False, text=True, capture_output=True, env=containers_conf())
    if result.returncode != 0:
        raise RuntimeError(f"podman build {tag} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")


@dataclass
class NodeNetwork:
    """A podman network for one cluster's node containers; the host is its gateway."""

    name: str
    subnet: ipaddress.IPv4Network

    @classmethod
    def create(cls, index: int) -> NodeNetwork:
        subnet = ipaddress.IPv4Network(f"{NODE_SUBNET_PREFIX}.{index % 250}.0/24")
        name = f"rldock-e2e-{index}"
        podman("network", "rm", "-f", name, check=False)
        # No podman DNS (aardvark) on the gateway: the pods' cluster DNS double serves there
        # (nodes/service_dns.py).
        podman("network", "create", "--disable-dns", "--subnet", str(subnet), "--gateway", str(subnet[1]), name)
        return cls(name, subnet)

    @property
    def gateway(self) -> str:
        return str(self.subnet[1])

    def node_ip(self, index: int) -> str:
        return str(self.subnet[10 + index])

    def remove(self) -> None:
        podman("network", "rm", "-f", self.name, check=False)

    def __enter__(self) -> NodeNetwork:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


@dataclass
class Node:
    name: str
    index: int
    container: str
    ip: str
    pod_cidr: str
    devices: int


@dataclass
class KindNodes:
    """Node containers joined to `control_plane`; `images` are OCI archives each node loads.
    `storage_root`, when given, is a host folder standing for `/` of every node for the paths
    under SHARED_STORAGE_PATH: its `mnt/rldock-shared` is mounted there in every node, the one
    filesystem all nodes share (as an NFS export mounted on every node would be), for hostPath
    volumes such as the checkpoint claim's (doubles/storage.py)."""

    control_plane: ControlPlane
    network: NodeNetwork
    images: list[Path] = field(default_factory=list)
    storage_root: Path | None = None
    nodes: dict[str, Node] = field(default_factory=dict)

    def __post_init__(self) -> None:
        binaries = build_node_binaries()
        self.node_image = build_node_image(binaries, local_base_image())
        self.images = [pause_archive(binaries), *self.images]
        self._stage = Path(tempfile.mkdtemp(prefix="rldock-nodes-"))
        (self._stage / "images").mkdir()
        for archive in self.images:  # hard links: one folder to mount, no copies
            target = self._stage / "images" / archive.name
            try:
                os.link(archive, target)
            except OSError:
                shutil.copy2(archive, target)
        admin = self.control_plane.users[credentials.ADMIN_USER]
        credentials.write_kubeconfig(
            self._stage / "kubeconfig", credentials.kubeconfig(self.control_plane.node_server, {admin.name: admin})
        )

    def __enter__(self) -> KindNodes:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def add(self, name: str, *, devices: int = 8) -> Node:
        index = len(self.nodes)
        node = Node(
            name,
            index,
            f"{self.network.name}-{name}",
            self.network.node_ip(index),
            f"{POD_SUBNET_PREFIX}.{index}.0/24",
            devices,
        )
        podman("rm", "-f", "-v", node.container, check=False)
        routes = ",".join(f"{other.pod_cidr} via {other.ip}" for other in self.nodes.values())
        podman(
            "run",
            "-d",
            "--privileged",
            "--name",
            node.container,
            "--hostname",
            name,
            "--network",
            self.network.name,
            "--ip",
            node.ip,
            "--volume",
            f"{self._stage / 'kubeconfig'}:/etc/rldock-node/kubeconfig:ro",
            "--volume",
            f"{self._stage / 'images'}:/images:ro",
            # containerd's overlay snapshots cannot sit on the container's own overlay root.
            "--volume",
            "/var/lib/containerd",
            "--volume",
            "/var/lib/kubelet",
            *(("--volume", f"{self._shared_storage()}:{SHARED_STORAGE_PATH}") if self.storage_root is not None else ()),
            "--env",
            f"NODE_NAME={name}",
            "--env",
            f"POD_CIDR={node.pod_cidr}",
            "--env",
            f"ROUTES={routes}",
            "--env",
            f"CLUSTER_DNS={self.network.gateway}",
            "--env",
            f"DEVICE_RESOURCE={DEVICE_RESOURCE}",
            "--env",
            f"DEVICES={devices}",
            "--env",
            f"API_SERVICE={self.control_plane.kubernetes_service_ip} "
            f"{self.control_plane.node_address}:{self.control_plane.ports['apiserver']}",
            self.node_image,
        )
        for other in self.nodes.values():  # the existing nodes learn the new node's pod range
            podman("exec", other.container, "ip", "route", "replace", node.pod_cidr, "via", node.ip)
        self.nodes[name] = node
        return node

    def _shared_storage(self) -> Path:
        assert self.storage_root is not None
        shared = self.storage_root / SHARED_STORAGE_PATH.lstrip("/")
        shared.mkdir(parents=True, exist_ok=True)
        # Writable by the images' non-root users: hostPath volumes keep the host's owner and mode.
        shared.chmod(0o1777)
        return shared

    def load_image(self, archive: Path) -> None:
        """Import an OCI archive into every running node's containerd (as nodes do at start)."""
        target = self._stage / "images" / archive.name
        if not target.exists():
            try:
                os.link(archive, target)
            except OSError:
                shutil.copy2(archive, target)
        self.images.append(archive)
        # All nodes at once: a multi-GB import is minutes per node, mostly waiting on the disk.
        imports = {
            node.name: subprocess.Popen(
                [
                    "podman",
                    "exec",
                    node.container,
                    "ctr",
                    "-n",
                    "k8s.io",
                    "images",
                    "import",
                    f"/images/{archive.name}",
                ],
                env=containers_conf(),
                text=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for node in self.nodes.values()
        }
        failed = {
            name: error
            for name, process in imports.items()
            if (error := process.communicate()[1]) is not None and process.returncode != 0
        }
        if failed:
            raise RuntimeError(f"importing {archive.name} failed on nodes {sorted(failed)}: {failed}")

    def wait_ready(self, *, timeout: float = 600.0) -> float:
        """Wait until every node is Ready, untainted and advertises its devices; seconds taken."""
        t0 = time.monotonic()

        def ready() -> bool:
            for node in self.nodes.values():
                self._check_running(node)
                try:
                    obj = self.control_plane.kubectl_json("get", "node", node.name)
                except RuntimeError:
                    return False
                conditions = {c["type"]: c["status"] for c in obj["status"].get("conditions", [])}
                if conditions.get("Ready") != "True" or obj["spec"].get("taints"):
                    return False
                if obj["status"].get("allocatable", {}).get(DEVICE_RESOURCE) in (None, "0"):
                    return False
            return True

        wait_for("kind-style nodes Ready with their devices", ready, timeout=timeout, interval=1.0)
        return time.monotonic() - t0

    def _check_running(self, node: Node) -> None:
        state = podman("inspect", "--format", "{{.State.Running}}", node.container, check=False)
        if state.stdout.strip() != "true":
            raise RuntimeError(f"node container {node.container} stopped; its log ends:\n{self.logs(node.name)}")

    def logs(self, name: str) -> str:
        out = podman("logs", "--tail", "40", self.nodes[name].container, check=False)
        return out.stdout + out.stderr

    def exec(self, name: str, *command: str) -> str:
        return podman("exec", self.nodes[name].container, *command).stdout

    def remove(self, name: str) -> None:
        node = self.nodes.pop(name)
        podman("rm", "-f", "-v", "-t", "5", node.container, check=False)  # -v: its anonymous volumes (images)
        _remove_cgroup_root(name)

    def stop(self) -> None:
        for name in list(self.nodes):
            self.remove(name)
        shutil.rmtree(self._stage, ignore_errors=True)


def _remove_cgroup_root(name: str) -> None:
    """The cgroups a node's kubelet made in the host's tree (node-entrypoint.sh), deepest first."""
    for hierarchy in Path("/sys/fs/cgroup").glob("*"):
        root = hierarchy / f"rldock-node-{name}"
        if not root.is_dir():
            continue
        children = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for directory in [*children, root]:  # a cgroup's files do not block rmdir, its children do
            try:
                directory.rmdir()
            except OSError as error:
                log.warning("could not remove cgroup %s: %s", directory, error)
