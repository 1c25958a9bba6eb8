"""NodeAgentDouble: a TEST DOUBLE of the kubelets of emulated nodes that RUNS their pods.

The control plane has no kubelet and no container runtime. This double creates emulated Ascend
nodes and plays their kubelets: every pod the real scheduler binds to one of them is run for real,
as local processes in a sandbox of Linux namespaces (sandbox.py: its own network with its own pod
IP on a bridge, its own mounts, hostname and PID namespaces), so the operator, KubeRay's double
and Ray see pods as they would in a cluster. Per pod, as a kubelet does:

- volumes are materialised in the pod's folder and mounted at their mountPaths: ConfigMap and
  Secret keys as files (read-only), emptyDir (medium Memory: a tmpfs), hostPath under `host_root`
  (every emulated node mounts the same shared filesystem there, as an NFS share would be), a
  PersistentVolumeClaim bound to a hostPath/local PersistentVolume likewise (storage.py binds
  claims: the PV controller is off), and the service-account token; paths are never rewritten;
- init containers run one after another, then the containers, with their env resolved
  (pod_env.py: values, Secret/ConfigMap refs, fieldRefs, `$(VAR)`) over the "image" env: the
  repository's virtual environment stands in for every image (`image_path` first on PATH, also
  for login shells through /etc/profile.d; HOME an image home whose .cache is the host's);
  `image` itself is ignored;
- status: phase, podIP, hostIP, conditions, container states with exit codes and restart counts;
  readiness from exec/httpGet readiness probes (KubeRay injects exec probes), Ready once running
  when there is none; restartPolicy Always/OnFailure restarts an exited container after a back-off
  (10 s doubling, at most `max_backoff`); Never leaves it terminated (phase Succeeded/Failed);
- the API server: Service default/kubernetes's ClusterIP is put on the bridge and forwarded to
  the API server (service_proxy.py), with the kubelet's KUBERNETES_SERVICE_* env, so in-cluster
  clients work (the token Secret mounted by the ServiceAccount admission plugin has ca.crt);
- names: /etc/hosts with the pod's name, and /etc/resolv.conf naming the cluster DNS double
  (cluster_dns.py), which resolves every Service's `svc.ns.svc.cluster.local` to the IP of a
  running pod its selector matches (DNS and kube-proxy in one), a headless Service's to every
  ready one's (one A record each, as CoreDNS answers), refreshed every round;
- a pod being deleted first runs its containers' preStop exec hooks (in each container's namespaces,
  as a kubelet does), for as long as they run within its deletionGracePeriodSeconds, the pod still
  reported running and terminating meanwhile; then SIGTERM, SIGKILL after its grace period (at most
  `max_grace` s), then it is confirmed gone; a pod that vanished (force-deleted) is killed at once. Nothing of a pod
  outlives it (sandbox.py), and `close` stops every pod and deletes the nodes.

What it does not do: liveness and startup probes, image pulls, resource limits (no cgroups),
ConfigMap/Secret volume refresh after start, other volume types, per-container mounts (a pod's containers
share the union of their volume mounts), ephemeral containers.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rldock_e2e.controlplane import ControlPlane
from rldock_e2e.controlplane.binaries import cache_dir
from rldock_e2e.controlplane.processes import ManagedProcess
from rldock_e2e.doubles import mountpoints
from rldock_e2e.doubles._poller import Poller
from rldock_e2e.doubles.cluster_dns import ClusterDNS, resolv_conf
from rldock_e2e.doubles.pod_env import MissingReference, container_env, expand
from rldock_e2e.doubles.sandbox import Mount, PodNetwork, PodSandbox, add_address, sandbox_unavailable, stop_processes
from rldock_e2e.doubles.service_proxy import ServiceProxy
from rldock_e2e.repo import REPO_ROOT

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
NODE_IP = "127.0.0.1"  # the emulated nodes' InternalIP (e2e/src/rldock_e2e/controlplane/nodes.py)
DEFAULT_IMAGE_PATH = (str(Path(sys.executable).parent),)
# What the "image" is made of on this host: the repository (the editable install's sources) and
# its venv. Pods see the host's file system, except /tmp, which is their own: a checkout that lies
# under /tmp (a CI clone) is therefore mounted into each pod at the same path.
IMAGE_DIRS = tuple(sorted({str(REPO_ROOT), sys.prefix}))
_SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class PodStartError(RuntimeError):
    """The pod cannot start yet (a missing ConfigMap, Secret or key); retried every round."""


@dataclass
class _Probe:
    spec: Mapping[str, Any]
    next_at: float = 0.0
    running: ManagedProcess | None = None
    started: float = 0.0
    successes: int = 0
    failures: int = 0


@dataclass
class _Container:
    spec: Mapping[str, Any]
    init: bool
    process: ManagedProcess | None = None
    started_at: str = ""
    started: float = 0.0
    restart_count: int = 0
    last_terminated: dict[str, Any] | None = None
    done: bool = False  # terminated for good (restartPolicy) or an init container that succeeded
    next_start: float = 0.0
    waiting_reason: str = "ContainerCreating"
    waiting_message: str = ""
    ready: bool = False
    probe: _Probe | None = None
    env: dict[str, str] = field(default_factory=dict)  # what it was started with (its exec hooks get it too)

    @property
    def name(self) -> str:
        return self.spec["name"]


@dataclass
class _PodRuntime:
    uid: str
    namespace: str
    name: str
    pod: dict[str, Any]
    root: Path
    sandbox: PodSandbox | None = None
    init: list[_Container] = field(default_factory=list)
    main: list[_Container] = field(default_factory=list)
    start_time: str = ""
    reported: dict[str, Any] | None = None
    pre_stop: list[ManagedProcess] | None = None  # the preStop hooks of a pod being deleted, once started
    pre_stop_until: float = 0.0  # when its grace period ends (time.monotonic)
    conditions: dict[str, tuple[str, str]] = field(default_factory=dict)  # type -> (status, since)

    @property
    def ip(self) -> str:
        return (
            self.sandbox.ip
            if self.sandbox is not None and self.sandbox.ip
            else (NODE_IP if self.sandbox is not None else "")
        )

    def processes(self) -> list[ManagedProcess]:
        found = []
        for container in (*self.init, *self.main):
            found += [p for p in (container.process, container.probe.running if container.probe else None) if p]
        return found + list(self.pre_stop or ())


class NodeAgentDouble:
    """Runs the pods bound to its emulated nodes (all namespaces), polling every `interval` s."""

    def __init__(
        self,
        plane: ControlPlane,
        *,
        workdir: Path,
        host_root: Path,
        image_path: Sequence[str] = DEFAULT_IMAGE_PATH,
        image_env: Mapping[str, str] | None = None,
        interval: float = 0.5,
        max_grace: float = 5.0,
        max_backoff: float = 60.0,
    ) -> None:
        self.plane = plane
        self.workdir, self.host_root = Path(workdir), Path(host_root)
        # The image's home: empty but for .cache, the host's (built models, compile caches, vLLM's
        # model-inspection cache), as a pre-warmed image would have; not the host's home, whose
        # shell profile (pyenv, ...) would put other Pythons before the image's on a login shell's
        # PATH. Not under the workdir either: that lies in /tmp, which every pod has its own of,
        # so HOME would not exist in the pod and every cache would start cold (minutes per vLLM
        # engine on two cores).
        self.image_home = cache_dir().parent / "e2e-image-home"
        self.image_env = {
            "PATH": ":".join([*image_path, _SYSTEM_PATH]),
            "HOME": str(self.image_home),
            "LANG": "C.UTF-8",
            **(image_env or {}),
        }
        self.max_grace, self.max_backoff = max_grace, max_backoff
        self.network = PodNetwork()
        self.dns: ClusterDNS | None = None
        self.api_proxy: ServiceProxy | None = None
        self._api = plane.api_client()
        self.core = client.CoreV1Api(self._api)
        self._nodes: set[str] = set()
        self._pods: dict[str, _PodRuntime] = {}
        self._lock = threading.RLock()
        self._poller = Poller("node-agent-double", self.sync, interval=interval)
        self.profile_dir = self.workdir / "image-profile.d"

    # ----- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> NodeAgentDouble:
        reason = sandbox_unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host_root.mkdir(parents=True, exist_ok=True)
        self.profile_dir.mkdir(exist_ok=True)
        self.image_home.mkdir(parents=True, exist_ok=True)
        host_cache = Path.home() / ".cache"
        host_cache.mkdir(exist_ok=True)
        if not (self.image_home / ".cache").is_symlink():
            (self.image_home / ".cache").symlink_to(host_cache)
        # Login shells (KubeRay's `bash -lc`) reset PATH in /etc/profile, then read profile.d.
        (self.profile_dir / "00-image-path.sh").write_text(f"export PATH={self.image_env['PATH']}\n")
        mountpoints.release(mine=False)  # what runs that died before cleaning up left behind
        self.network.create()
        self.dns = ClusterDNS(self.network.gateway)
        self.dns.start()
        # kube-proxy's part for Service default/kubernetes: its ClusterIP on the bridge, forwarded
        # to the API server (in-cluster clients, e.g. an operator Deployment, use it).
        add_address(self.network.bridge, self.plane.kubernetes_service_ip)
        self.api_proxy = ServiceProxy(
            (self.plane.kubernetes_service_ip, 443), ("127.0.0.1", self.plane.ports["apiserver"])
        )
        self.api_proxy.start()
        self._poller.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        self._poller.stop()
        with self._lock:
            for runtime in list(self._pods.values()):
                self._kill(runtime, grace=0)
            self._pods.clear()
        if self.dns is not None:
            self.dns.stop()
        if self.api_proxy is not None:
            self.api_proxy.stop()
        self.network.destroy()
        if self._nodes:
            self.plane.kubectl("delete", "nodes", *sorted(self._nodes), "--wait=false", check=False)
            self._nodes.clear()
        mountpoints.release()
        self._api.close()

    @property
    def errors(self) -> list[BaseException]:
        return self._poller.errors

    def add_node(self, name: str, **create_node_kwargs: Any) -> dict:
        """Create an emulated node (ControlPlane.create_node) whose pods this agent runs."""
        with self._lock:
            self._nodes.add(name)
        return self.plane.create_node(name, **create_node_kwargs)

    # ----- what tests ask -------------------------------------------------------------------------
    def pids(self, namespace: str | None = None, *, labels: Mapping[str, str] = {}) -> dict[str, list[int]]:
        """Live processes of every running pod (of `namespace`, with these labels), by pod name."""
        with self._lock:
            return {r.name: r.sandbox.pids() for r in self._selected(namespace, labels) if r.sandbox is not None}

    def uts_namespaces(self, namespace: str | None = None, *, labels: Mapping[str, str] = {}) -> dict[str, int]:
        """The UTS namespace inode of every running pod (of `namespace`, with these labels), by pod
        name: all of a pod's processes share it (leak checks after the pod is gone)."""
        with self._lock:
            return {
                r.name: r.sandbox.uts_inode
                for r in self._selected(namespace, labels)
                if r.sandbox is not None and r.sandbox.uts_inode
            }

    def _selected(self, namespace: str | None, labels: Mapping[str, str]) -> list[_PodRuntime]:
        return [
            r
            for r in self._pods.values()
            if namespace in (None, r.namespace)
            and all((r.pod["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items())
        ]

    def container_pid(self, namespace: str, pod: str, container: str) -> int | None:
        """Host pid of a running container's first process (PID 1 of its PID namespace)."""
        with self._lock:
            runtime = next((r for r in self._pods.values() if (r.namespace, r.name) == (namespace, pod)), None)
            found = next((c for c in runtime.main if c.name == container), None) if runtime else None
            if found is None or found.process is None:
                return None
            # nsenter execs unshare (this pid), whose one child is the container's PID 1.
            children = Path(f"/proc/{found.process.pid}/task/{found.process.pid}/children")
            try:
                first = children.read_text().split()
            except FileNotFoundError:
                return None
            return int(first[0]) if first else None

    def log_path(self, namespace: str, pod: str, container: str) -> Path:
        return self.workdir / "pods" / namespace / pod / "logs" / f"{container}.log"

    # ----- one round ------------------------------------------------------------------------------
    def sync(self) -> None:
        with self._lock:
            if not self._nodes:
                return
            pods = json.loads(self.core.list_pod_for_all_namespaces(_preload_content=False).data)["items"]
            mine = [p for p in pods if p["spec"].get("nodeName") in self._nodes]
            seen = set()
            for pod in mine:
                uid = pod["metadata"]["uid"]
                seen.add(uid)
                runtime = self._pods.get(uid)
                if pod["metadata"].get("deletionTimestamp"):
                    self._delete(pod, runtime)
                    continue
                if runtime is None:
                    if pod.get("status", {}).get("phase", "Pending") != "Pending":
                        continue  # finished (or run by an earlier agent): nothing to do
                    runtime = self._admit(pod)
                runtime.pod = pod
                self._step(runtime)
            for uid in [u for u in self._pods if u not in seen]:  # force-deleted: kill at once
                runtime = self._pods.pop(uid)
                log.info("pod %s/%s vanished; killing it", runtime.namespace, runtime.name)
                self._kill(runtime, grace=0)
            self._publish_services(pods)
            for runtime in list(self._pods.values()):
                self._report(runtime)

    # ----- admission and start --------------------------------------------------------------------
    def _admit(self, pod: Mapping[str, Any]) -> _PodRuntime:
        meta, spec = pod["metadata"], pod["spec"]
        runtime = _PodRuntime(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            pod=dict(pod),
            root=self.workdir / "pods" / meta["namespace"] / meta["name"],
            start_time=_now(),
        )
        runtime.init = [_Container(spec=c, init=True) for c in spec.get("initContainers") or ()]
        runtime.main = [_Container(spec=c, init=False) for c in spec["containers"]]
        for container in runtime.main:
            if container.spec.get("readinessProbe"):
                container.probe = _Probe(spec=container.spec["readinessProbe"])
        self._pods[runtime.uid] = runtime
        log.info("admitted pod %s/%s on %s", runtime.namespace, runtime.name, spec["nodeName"])
        return runtime

    def _start_sandbox(self, runtime: _PodRuntime) -> None:
        root = runtime.root
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        (root / "tmp").chmod(0o1777)
        (root / "hosts").write_text("")
        host_network = bool(runtime.pod["spec"].get("hostNetwork"))
        mounts = self._volume_mounts(runtime)
        targets = {m.target for m in mounts}
        mounts += [Mount("/etc/hosts", root / "hosts"), Mount("/etc/profile.d", self.profile_dir, read_only=True)]
        if "/tmp" not in targets:  # the container's own /tmp, unless the pod mounts a volume there
            mounts.append(Mount("/tmp", root / "tmp"))
        mounts += [Mount(d, Path(d)) for d in IMAGE_DIRS if Path(d).is_relative_to("/tmp") and d not in targets]
        if not host_network:  # dnsPolicy ClusterFirst
            assert self.dns is not None
            (root / "resolv.conf").write_text(resolv_conf(self.dns.address, runtime.namespace))
            mounts.append(Mount("/etc/resolv.conf", root / "resolv.conf"))
        if "/dev/shm" not in targets:
            mounts.append(Mount("/dev/shm", None, tmpfs_size="64m"))  # a container runtime's default
        sandbox = PodSandbox(
            name=runtime.name, root=root, mounts=mounts, network=None if host_network else self.network
        )
        sandbox.prepare_mountpoints()
        sandbox.start()
        runtime.sandbox = sandbox
        # In place: /etc/hosts in the pod is a bind mount of this very file.
        with open(root / "hosts", "r+") as out:
            out.write(
                f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n{runtime.ip}\t{runtime.name}\n"
            )

    def _volume_mounts(self, runtime: _PodRuntime) -> list[Mount]:
        pod = runtime.pod
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or ()}
        mounts: dict[str, Mount] = {}
        for container in (*pod["spec"].get("initContainers", ()), *pod["spec"]["containers"]):
            for volume_mount in container.get("volumeMounts") or ():
                target = volume_mount["mountPath"]
                if target in mounts:
                    continue
                volume = volumes[volume_mount["name"]]
                read_only = bool(volume_mount.get("readOnly"))
                source = self._volume_source(runtime, volume)
                if source is None:
                    mounts[target] = Mount(target, None, tmpfs_size=(volume["emptyDir"] or {}).get("sizeLimit"))
                    continue
                if volume_mount.get("subPath"):
                    source = source / volume_mount["subPath"]
                mounts[target] = Mount(
                    target, source, read_only=read_only or "configMap" in volume or "secret" in volume
                )
        return list(mounts.values())

    def _volume_source(self, runtime: _PodRuntime, volume: Mapping[str, Any]) -> Path | None:
        """The host folder that backs `volume` (filled now), or None for a memory-backed emptyDir."""
        folder = runtime.root / "volumes" / volume["name"]
        if "configMap" in volume or "secret" in volume:
            ref = volume.get("configMap") or volume["secret"]
            name = ref.get("name") or ref.get("secretName")
            data = self._read_data("configMap" if "configMap" in volume else "secret", runtime.namespace, name)
            if data is None:
                if ref.get("optional"):
                    data = {}
                else:
                    raise PodStartError(f"{'configmap' if 'configMap' in volume else 'secret'} {name!r} not found")
            items = ref.get("items") or [{"key": key, "path": key} for key in data]
            folder.mkdir(parents=True, exist_ok=True)
            for item in items:
                if item["key"] not in data:
                    raise PodStartError(f"key {item['key']!r} not in {name!r}")
                path = folder / item["path"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data[item["key"]])
            return folder
        if "emptyDir" in volume:
            if (volume["emptyDir"] or {}).get("medium") == "Memory":
                return None
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        if "hostPath" in volume:
            path = self.host_root / volume["hostPath"]["path"].lstrip("/")
            if volume["hostPath"].get("type", "") in ("", "DirectoryOrCreate"):
                path.mkdir(parents=True, exist_ok=True)
            elif not path.exists():
                raise PodStartError(f"hostPath {volume['hostPath']['path']} does not exist")
            return path
        if "persistentVolumeClaim" in volume:
            return self._claim_source(runtime.namespace, volume["persistentVolumeClaim"]["claimName"])
        raise PodStartError(
            f"volume {volume['name']!r}: only configMap, secret, emptyDir, hostPath and "
            "persistentVolumeClaim (of a hostPath or local volume) volumes are emulated"
        )

    def _claim_source(self, namespace: str, claim: str) -> Path:
        """A bound claim's volume, as the kubelet mounts it: a hostPath or local PersistentVolume's
        path, under `host_root` like every hostPath."""
        try:
            pvc = json.loads(
                self.core.read_namespaced_persistent_volume_claim(claim, namespace, _preload_content=False).data
            )
            volume_name = pvc["spec"].get("volumeName")
            if not volume_name:
                raise PodStartError(f"persistentvolumeclaim {claim!r} is not bound")
            pv = json.loads(self.core.read_persistent_volume(volume_name, _preload_content=False).data)
        except ApiException as error:
            if error.status == 404:
                raise PodStartError(f"persistentvolumeclaim {claim!r} or its volume not found") from None
            raise
        source = pv["spec"].get("hostPath") or pv["spec"].get("local")
        if source is None:
            raise PodStartError(f"persistentvolume {volume_name!r}: only hostPath and local volumes are emulated")
        path = self.host_root / source["path"].lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _read_data(self, kind: str, namespace: str, name: str) -> dict[str, bytes] | None:
        read = self.core.read_namespaced_config_map if kind == "configMap" else self.core.read_namespaced_secret
        try:
            obj = json.loads(read(name, namespace, _preload_content=False).data)
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        if kind == "secret":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        return {
            **{k: v.encode() for k, v in (obj.get("data") or {}).items()},
            **{k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()},
        }

    def _env_lookup(self, kind: str, namespace: str):
        def lookup(name: str) -> dict[str, str] | None:
            data = self._read_data(kind, namespace, name)
            if data is None:
                return None
            # pod_env wants Secret values base64-encoded, as the API serves them.
            return {k: base64.b64encode(v).decode() if kind == "secret" else v.decode() for k, v in data.items()}

        return lookup

    # ----- the state machine ----------------------------------------------------------------------
    def _step(self, runtime: _PodRuntime) -> None:
        if runtime.sandbox is None:
            try:
                self._start_sandbox(runtime)
            except PodStartError as error:
                for container in (*runtime.init, *runtime.main):
                    container.waiting_reason, container.waiting_message = "CreateContainerConfigError", str(error)
                return
        pending_init = next((c for c in runtime.init if not c.done), None)
        if pending_init is not None:
            self._run(runtime, pending_init)
            return
        for container in runtime.main:
            self._run(runtime, container)
            self._probe(runtime, container)

    def _policy(self, runtime: _PodRuntime, container: _Container) -> str:
        if container.init:  # init containers are retried unless the pod never restarts
            return "Never" if runtime.pod["spec"].get("restartPolicy") == "Never" else "OnFailure"
        return runtime.pod["spec"].get("restartPolicy", "Always")

    def _run(self, runtime: _PodRuntime, container: _Container) -> None:
        now = time.monotonic()
        if container.process is None:
            if not container.done and now >= container.next_start:
                self._start_container(runtime, container)
            return
        code = container.process.poll()
        if code is None:
            return
        container.process.stop(timeout=0)
        container.process = None
        container.ready = False
        exit_code = code if code >= 0 else 128 - code  # killed by signal N: 128 + N, as a kubelet reports
        container.last_terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": container.started_at,
            "finishedAt": _now(),
        }
        log.info("pod %s/%s container %s exited with %d", runtime.namespace, runtime.name, container.name, exit_code)
        policy = self._policy(runtime, container)
        if policy == "Always" or (policy == "OnFailure" and exit_code != 0):
            container.restart_count += 1
            container.next_start = now + min(10.0 * 2 ** (container.restart_count - 1), self.max_backoff)
            container.waiting_reason, container.waiting_message = (
                "CrashLoopBackOff",
                (f"back-off restarting failed container {container.name}"),
            )
        else:
            container.done = True

    def _start_container(self, runtime: _PodRuntime, container: _Container) -> None:
        spec = container.spec
        api = self.plane.kubernetes_service_ip
        # The image's env, then the kubelet's service links of Service default/kubernetes.
        image_env = dict(
            self.image_env,
            HOSTNAME=runtime.name,
            KUBERNETES_SERVICE_HOST=api,
            KUBERNETES_SERVICE_PORT="443",
            KUBERNETES_SERVICE_PORT_HTTPS="443",
            KUBERNETES_PORT=f"tcp://{api}:443",
            KUBERNETES_PORT_443_TCP=f"tcp://{api}:443",
            KUBERNETES_PORT_443_TCP_PROTO="tcp",
            KUBERNETES_PORT_443_TCP_PORT="443",
            KUBERNETES_PORT_443_TCP_ADDR=api,
        )
        try:
            env = container_env(
                runtime.pod,
                spec,
                config_map=self._env_lookup("configMap", runtime.namespace),
                secret=self._env_lookup("secret", runtime.namespace),
                pod_ip=runtime.ip,
                host_ip=NODE_IP,
                image_env=image_env,
            )
        except MissingReference as error:
            container.waiting_reason, container.waiting_message = "CreateContainerConfigError", str(error)
            return
        argv = [expand(word, env) for word in (*(spec.get("command") or ()), *(spec.get("args") or ()))]
        if not spec.get("command"):
            container.waiting_reason, container.waiting_message = (
                "CreateContainerError",
                "the emulated image has no entrypoint: set the container's command",
            )
            return
        assert runtime.sandbox is not None
        container.process = runtime.sandbox.exec(
            container.name, argv, env=env, working_dir=spec.get("workingDir") or "/"
        )
        container.env = dict(env)
        container.started_at, container.started = _now(), time.monotonic()
        if container.probe is not None:
            container.probe = _Probe(spec=container.probe.spec)  # a restart probes afresh
        log.info(
            "pod %s/%s started %s (pid %d)", runtime.namespace, runtime.name, container.name, container.process.pid
        )

    def _probe(self, runtime: _PodRuntime, container: _Container) -> None:
        """Readiness: Ready when running without a probe; with one, its thresholds decide."""
        if container.process is None:
            container.ready = False
            return
        probe = container.probe
        if probe is None:
            container.ready = True
            return
        spec, now = probe.spec, time.monotonic()
        if probe.running is not None:
            code = probe.running.poll()
            timed_out = now - probe.started > float(spec.get("timeoutSeconds", 1))
            if code is None and not timed_out:
                return
            probe.running.stop(timeout=0)
            probe.running = None
            if code == 0:
                probe.successes, probe.failures = probe.successes + 1, 0
                if probe.successes >= int(spec.get("successThreshold", 1)):
                    container.ready = True
            else:
                probe.failures, probe.successes = probe.failures + 1, 0
                if probe.failures >= int(spec.get("failureThreshold", 3)):
                    container.ready = False
            return
        if now < container.started + float(spec.get("initialDelaySeconds", 0)) or now < probe.next_at:
            return
        probe.next_at = now + float(spec.get("periodSeconds", 10))
        probe.started = now
        assert runtime.sandbox is not None
        if "exec" in spec:
            probe.running = runtime.sandbox.exec(
                f"{container.name}.probe", spec["exec"]["command"], env=self.image_env, own_pid_namespace=False
            )
        elif "httpGet" in spec:
            get = spec["httpGet"]
            port = get["port"]
            if isinstance(port, str) and not port.isdigit():  # a named container port
                port = next(p["containerPort"] for p in container.spec.get("ports") or () if p.get("name") == port)
            url = f"http://{runtime.ip}:{port}{get.get('path', '/')}"
            probe.running = ManagedProcess(
                f"pod {runtime.name}: {container.name}.probe",
                ["wget", "-q", "-O", "/dev/null", url],
                log_path=runtime.root / "logs" / f"{container.name}.probe.log",
            )
        else:
            container.ready = True  # tcpSocket/grpc probes are not emulated: taken as passing

    # ----- deletion -------------------------------------------------------------------------------
    def _delete(self, pod: Mapping[str, Any], runtime: _PodRuntime | None) -> None:
        if runtime is not None:
            if self._pre_stop_running(pod, runtime):
                return  # terminating: stopped once its hooks end or its grace period does
            grace = min(float(pod["metadata"].get("deletionGracePeriodSeconds") or 0), self.max_grace)
            self._kill(runtime, grace=grace)
            self._pods.pop(runtime.uid, None)
        try:
            self.core.delete_namespaced_pod(
                pod["metadata"]["name"], pod["metadata"]["namespace"], grace_period_seconds=0, _preload_content=False
            )
        except ApiException as error:
            if error.status != 404:
                raise

    def _pre_stop_running(self, pod: Mapping[str, Any], runtime: _PodRuntime) -> bool:
        """Start the running containers' preStop exec hooks the first time the pod is seen deleted; then
        whether one still runs within the pod's deletionGracePeriodSeconds (after it, what runs is stopped)."""
        if runtime.pre_stop is None:
            runtime.pre_stop = []
            grace = float(pod["metadata"].get("deletionGracePeriodSeconds") or 0)
            runtime.pre_stop_until = time.monotonic() + grace
            for container in runtime.main:
                hook = ((container.spec.get("lifecycle") or {}).get("preStop") or {}).get("exec")
                target = self.container_pid(runtime.namespace, runtime.name, container.name)
                if hook and target is not None and runtime.sandbox is not None and grace > 0:
                    log.info("pod %s/%s: running %s's preStop hook", runtime.namespace, runtime.name, container.name)
                    runtime.pre_stop.append(
                        runtime.sandbox.exec_in(f"{container.name}.preStop", target, hook["command"], env=container.env)
                    )
        running = [hook for hook in runtime.pre_stop if hook.poll() is None]
        if running and time.monotonic() < runtime.pre_stop_until:
            return True
        for hook in running:
            hook.stop(timeout=0)
        return False

    def _kill(self, runtime: _PodRuntime, *, grace: float) -> None:
        if runtime.sandbox is not None:
            runtime.sandbox.stop(grace=grace, processes=runtime.processes())
        else:
            stop_processes(runtime.processes(), grace=0)
        log.info("pod %s/%s stopped", runtime.namespace, runtime.name)

    # ----- Service names and status ---------------------------------------------------------------
    def _publish_services(self, pods: list[dict[str, Any]]) -> None:
        """Point every Service's DNS name at the pods it selects (service_addresses)."""
        services = json.loads(self.core.list_service_for_all_namespaces(_preload_content=False).data)["items"]
        local = {r.uid: r.ip for r in self._pods.values() if r.ip}  # not yet in the pods' status

        def ip_of(pod: Mapping[str, Any]) -> str:
            return pod.get("status", {}).get("podIP") or local.get(pod["metadata"]["uid"], "")

        assert self.dns is not None
        self.dns.set_services(service_addresses(services, pods, ip_of=ip_of))

    def _report(self, runtime: _PodRuntime) -> None:
        status = self._status(runtime)
        if status == runtime.reported:
            return
        try:
            self.core.patch_namespaced_pod_status(
                runtime.name, runtime.namespace, {"status": status}, _content_type=MERGE_PATCH, _preload_content=False
            )
        except ApiException as error:
            if error.status != 404:
                raise
            return
        runtime.reported = status

    def _status(self, runtime: _PodRuntime) -> dict[str, Any]:
        init_done = all(c.done for c in runtime.init)
        init_failed = any(c.done and (c.last_terminated or {}).get("exitCode") for c in runtime.init)
        mains = runtime.main
        if init_failed:
            phase = "Failed"
        elif not init_done or any(c.process is None and not c.done and c.restart_count == 0 for c in mains):
            phase = "Pending"
        elif all(c.done for c in mains):
            phase = "Succeeded" if all(c.last_terminated["exitCode"] == 0 for c in mains) else "Failed"
        else:
            phase = "Running"
        ready = phase == "Running" and all(c.ready for c in mains)
        conditions = [
            self._condition(runtime, "Initialized", init_done),
            self._condition(runtime, "Ready", ready),
            self._condition(runtime, "ContainersReady", ready),
            self._condition(runtime, "PodScheduled", True),
        ]
        status: dict[str, Any] = {
            "phase": phase,
            "hostIP": NODE_IP,
            "startTime": runtime.start_time,
            "conditions": conditions,
            "containerStatuses": [self._container_status(c) for c in mains],
        }
        if runtime.init:
            status["initContainerStatuses"] = [self._container_status(c) for c in runtime.init]
        if runtime.ip:
            status.update(podIP=runtime.ip, podIPs=[{"ip": runtime.ip}])
        return status

    @staticmethod
    def _condition(runtime: _PodRuntime, type_: str, value: bool) -> dict[str, str]:
        status = "True" if value else "False"
        previous = runtime.conditions.get(type_)
        if previous is None or previous[0] != status:
            runtime.conditions[type_] = (status, _now())
        return {"type": type_, "status": status, "lastTransitionTime": runtime.conditions[type_][1]}

    @staticmethod
    def _container_status(container: _Container) -> dict[str, Any]:
        if container.process is not None:
            state: dict[str, Any] = {"running": {"startedAt": container.started_at}}
        elif container.done and container.last_terminated is not None:
            state = {"terminated": container.last_terminated}
        else:
            state = {
                "waiting": {
                    "reason": container.waiting_reason,
                    **({"message": container.waiting_message} if container.waiting_message else {}),
                }
            }
        status = {
            "name": container.name,
            "image": container.spec.get("image", ""),
            "imageID": "",
            "ready": container.ready,
            "restartCount": container.restart_count,
            "started": container.process is not None,
            "state": state,
        }
        if container.last_terminated is not None and "terminated" not in state:
            status["lastState"] = {"terminated": container.last_terminated}
        return status


def service_addresses(
    services: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    *,
    ip_of: Callable[[Mapping[str, Any]], str],
) -> dict[tuple[str, str], str | tuple[str, ...]]:
    """(namespace, service) -> what its DNS name answers. A ClusterIP Service: the address of one
    running pod it selects, ready ones first (the pod stands in for the Service's IP, which nothing
    here routes). A headless Service (`clusterIP: None`): every ready pod's address, in name order
    (with `publishNotReadyAddresses` every running one's), as the cluster DNS answers it; none ready,
    no name. A Service without a selector has no name here."""
    addresses: dict[tuple[str, str], str | tuple[str, ...]] = {}
    for service in services:
        spec = service["spec"]
        selector = spec.get("selector")
        if not selector:
            continue
        namespace = service["metadata"]["namespace"]
        backends = sorted(
            (
                p
                for p in pods
                if p["metadata"]["namespace"] == namespace
                and ip_of(p)
                and not p["metadata"].get("deletionTimestamp")
                and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            ),
            key=lambda p: (not _is_ready(p), p["metadata"]["name"]),
        )
        key = (namespace, service["metadata"]["name"])
        if spec.get("clusterIP") == "None":
            published = [p for p in backends if spec.get("publishNotReadyAddresses") or _is_ready(p)]
            if published:
                addresses[key] = tuple(ip_of(p) for p in sorted(published, key=lambda p: p["metadata"]["name"]))
        elif backends:
            addresses[key] = ip_of(backends[0])
    return addresses


def _is_ready(pod: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in pod.get("status", {}).get("conditions") or ()
    )
