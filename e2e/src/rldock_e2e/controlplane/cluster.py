"""A real Kubernetes 1.20 control plane on loopback for e2e tests: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler as local processes, with helpers to drive it.

    with ControlPlane() as cp:
        cp.create_node("npu-0", devices=8)
        cp.kubectl("get", "nodes")

Every port is picked free, every file lives in a temp folder, and every process is stopped on
exit -- also when the body raises, the run is interrupted or the interpreter dies (processes.py).
There is no kubelet: pods the scheduler binds stay Pending until a node-agent test double runs
them (see e2e/README.md).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from . import crds, credentials, nodes
from .binaries import Binaries, find_binaries
from .processes import ManagedProcess, free_ports

log = logging.getLogger(__name__)

T = TypeVar("T")

# Service ClusterIPs come from 10.96.<k>.0/24, k from the API server's port: concurrent control
# planes then differ, which matters once the node agent double routes pods to the `kubernetes`
# Service's address (its .1) on this machine.
SERVICE_CLUSTER_IP_PREFIX = "10.96"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc"
# Controllers that need a kubelet, a cloud or a pod network are off; the rest (garbage
# collector, namespaces, service accounts and tokens, replica sets, jobs, ...) run.
CONTROLLERS = (
    "*,-nodeipam,-nodelifecycle,-attachdetach,-persistentvolume-binder,-pvc-protection,"
    "-pv-protection,-route,-service,-cloud-node-lifecycle"
)
_START_ATTEMPTS = 3


class ControlPlaneError(RuntimeError):
    """A server did not come up; the message carries the tail of its log."""


class KubectlError(RuntimeError):
    def __init__(self, args: Iterable[str], returncode: int, stderr: str) -> None:
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(f"kubectl {' '.join(args)} failed ({returncode}): {stderr.strip()}")


def wait_for(
    what: str,
    probe: Callable[[], T],
    *,
    timeout: float,
    interval: float = 0.5,
    check: Callable[[], None] = lambda: None,
) -> T:
    """Poll `probe` until it returns something truthy; `check` may raise to give up early."""
    deadline = time.monotonic() + timeout
    while True:
        check()
        result = probe()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler 1.20.2 on 127.0.0.1.

    Args:
        workdir: folder for data, certs, keys, logs and the kubeconfig. Default: a temp folder
            removed on stop (a given folder is kept, so pytest's tmp_path keeps the logs).
        build: build the binaries with build.sh when they are not cached (cold: ~12 minutes).
        start_timeout: seconds to wait for each server to become healthy.
        node_address: for real kubelets (rldock_e2e.nodes): the API server also listens on this
            address of the machine (one node containers reach), advertises it to pods, reaches
            kubelets by their InternalIP (`kubectl logs/exec`), and the node-lifecycle
            controller runs (it lifts a Ready node's not-ready taint and marks silent nodes).
        audit_users: users whose requests the API server writes to its audit log
            (`<workdir>/logs/audit.log`, one JSON event a line at level Metadata: verb, resource,
            namespace, name, user; read back with `audit_events`), so a test counts a client's
            calls where they arrive, whatever library made them. Empty (the default): no audit log.
    """

    def __init__(
        self,
        *,
        workdir: Path | None = None,
        build: bool = True,
        start_timeout: float = 180.0,
        node_address: str | None = None,
        audit_users: Iterable[str] = (),
    ) -> None:
        self._given_workdir = Path(workdir) if workdir is not None else None
        self.audit_users = tuple(audit_users)
        self._build = build
        self._start_timeout = start_timeout
        self.node_address = node_address
        self._processes: list[ManagedProcess] = []
        self.workdir: Path | None = None
        self.binaries: Binaries | None = None
        self.users = credentials.default_users()
        self.server = ""
        self.kubeconfig: Path | None = None
        self.ports: dict[str, int] = {}
        self.start_seconds = 0.0

    # ----- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def service_cidr(self) -> str:
        return f"{SERVICE_CLUSTER_IP_PREFIX}.{self.ports['apiserver'] % 250 + 1}.0/24"

    @property
    def kubernetes_service_ip(self) -> str:
        """The ClusterIP of Service default/kubernetes: the first address of the service range."""
        return self.service_cidr.replace(".0/24", ".1")

    @property
    def pids(self) -> dict[str, int]:
        """Process id of each server started (also its process-group id)."""
        return {p.name: p.pid for p in self._processes}

    def start(self) -> ControlPlane:
        t0 = time.monotonic()
        self.binaries = find_binaries(build=self._build)
        if self._given_workdir is not None:
            self.workdir = self._given_workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="rldock-controlplane-"))
        try:
            for attempt in range(_START_ATTEMPTS):
                try:
                    self._start_servers()
                    break
                except ControlPlaneError as error:
                    # Ports are picked free but released before the servers bind them; another
                    # process may take one in between. Retry with fresh ports and a fresh etcd.
                    if "address already in use" not in str(error) or attempt + 1 == _START_ATTEMPTS:
                        raise
                    log.warning("port taken while starting, retrying: %s", error)
                    self._stop_processes()
                    shutil.rmtree(self.workdir / "etcd", ignore_errors=True)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        log.info("control plane up at %s in %.1f s (workdir %s)", self.server, self.start_seconds, self.workdir)
        return self

    def stop(self) -> None:
        """Stop every server (newest first) and remove an own temp workdir. Idempotent."""
        self._stop_processes()
        if self._given_workdir is None and self.workdir is not None and self.workdir.exists():
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _stop_processes(self) -> None:
        while self._processes:
            self._processes.pop().stop()

    def _start_servers(self) -> None:
        work = self.workdir
        for sub in ("etcd", "certs", "logs", "kube-cache"):
            (work / sub).mkdir(exist_ok=True)
        names = ("etcd-client", "etcd-peer", "apiserver", "controller-manager", "scheduler")
        self.ports = dict(zip(names, free_ports(len(names))))
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        sa_key, sa_pub = credentials.write_service_account_keys(work / "certs")
        tokens = credentials.write_token_file(work / "certs" / "tokens.csv", self.users)
        self.kubeconfig = credentials.write_kubeconfig(
            work / "kubeconfig", credentials.kubeconfig(self.server, self.users)
        )

        etcd_url = f"http://127.0.0.1:{self.ports['etcd-client']}"
        self._spawn(
            "etcd",
            [
                str(self.binaries.etcd),
                "--name=rldock-e2e",
                f"--data-dir={work / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{self.ports['etcd-peer']}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{self.ports['etcd-peer']}",
                f"--initial-cluster=rldock-e2e=http://127.0.0.1:{self.ports['etcd-peer']}",
                # KubeRay's CRDs are over a megabyte each; etcd's default request limit is 1.5 MiB.
                "--max-request-bytes=8388608",
                "--log-level=warn",
            ],
        )
        self._wait_http("etcd", f"{etcd_url}/health")

        self._spawn(
            "kube-apiserver",
            [
                str(self.binaries.kube_apiserver),
                f"--etcd-servers={etcd_url}",
                *self._apiserver_address_flags(),
                f"--secure-port={self.ports['apiserver']}",
                "--insecure-port=0",
                f"--cert-dir={work / 'certs' / 'apiserver'}",
                f"--token-auth-file={tokens}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={sa_pub}",
                f"--service-account-signing-key-file={sa_key}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                f"--service-cluster-ip-range={self.service_cidr}",
                "--allow-privileged=true",
                "--profiling=false",
                *self._audit_flags(),
            ],
        )
        self._wait_http("kube-apiserver", f"{self.server}/readyz")

        for name, port_name, extra in (
            (
                "kube-controller-manager",
                "controller-manager",
                [
                    f"--service-account-private-key-file={sa_key}",
                    f"--controllers={self._controllers()}",
                    # Service-account token Secrets then carry ca.crt: the API server's self-signed
                    # certificate (with its CA), which names the `kubernetes` Service's ClusterIP, so
                    # in-cluster clients (a pod the node agent double runs) verify it.
                    f"--root-ca-file={work / 'certs' / 'apiserver' / 'apiserver.crt'}",
                ],
            ),
            ("kube-scheduler", "scheduler", []),
        ):
            binary = getattr(self.binaries, name.replace("-", "_"))
            self._spawn(
                name,
                [
                    str(binary),
                    f"--kubeconfig={self.kubeconfig}",
                    "--leader-elect=false",
                    "--port=0",
                    f"--secure-port={self.ports[port_name]}",
                    "--bind-address=127.0.0.1",
                    f"--cert-dir={work / 'certs' / name}",
                    *extra,
                ],
            )
        for name, port_name in (("kube-controller-manager", "controller-manager"), ("kube-scheduler", "scheduler")):
            self._wait_http(name, f"https://127.0.0.1:{self.ports[port_name]}/healthz")
        # The controller manager's service-account and token controllers must have run before
        # any pod can be admitted in a namespace.
        self._wait_service_account("default")

    @property
    def audit_log(self) -> Path:
        return self.workdir / "logs" / "audit.log"

    def _audit_flags(self) -> list[str]:
        if not self.audit_users:
            return []
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(
            json.dumps(
                {
                    "apiVersion": "audit.k8s.io/v1",
                    "kind": "Policy",
                    # One event per request once it is answered (a watch: once it ends).
                    "omitStages": ["RequestReceived", "ResponseStarted"],
                    "rules": [{"level": "Metadata", "users": list(self.audit_users)}, {"level": "None"}],
                }
            )
        )
        # Blocking mode: an event is in the file before the API server answers the request.
        return [f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-mode=blocking"]

    def audit_events(self) -> list[dict]:
        """The audit log's events so far (needs audit_users), oldest first."""
        assert self.audit_users, "ControlPlane(audit_users=...) was not given"
        if not self.audit_log.exists():
            return []
        return [json.loads(line) for line in self.audit_log.read_text().splitlines() if line.strip()]

    def _apiserver_address_flags(self) -> list[str]:
        if self.node_address is None:
            return ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"]
        # All addresses: the loopback for the tests, node_address for the node containers.
        return [
            "--bind-address=0.0.0.0",
            f"--advertise-address={self.node_address}",
            "--kubelet-preferred-address-types=InternalIP",
        ]

    def _controllers(self) -> str:
        return CONTROLLERS if self.node_address is None else CONTROLLERS.replace(",-nodelifecycle", "")

    @property
    def node_server(self) -> str:
        """The API server's URL as node containers reach it (needs node_address)."""
        assert self.node_address is not None, "ControlPlane(node_address=...) was not given"
        return f"https://{self.node_address}:{self.ports['apiserver']}"

    def _spawn(self, name: str, argv: list[str]) -> None:
        self._processes.append(
            ManagedProcess(name, argv, log_path=self.workdir / "logs" / f"{name}.log", cwd=self.workdir)
        )

    def _check_running(self) -> None:
        for process in self._processes:
            code = process.poll()
            if code is not None:
                raise ControlPlaneError(
                    f"{process.name} exited with {code}; its log ({process.log_path}) ends:\n{process.log_tail()}"
                )

    def _wait_http(self, name: str, url: str) -> None:
        try:
            wait_for(
                f"{name} at {url}",
                lambda: self._get(url) == 200,
                timeout=self._start_timeout,
                check=self._check_running,
            )
        except TimeoutError as error:
            process = next(p for p in self._processes if p.name == name)
            raise ControlPlaneError(f"{error}; {name}'s log ends:\n{process.log_tail()}") from None

    def _get(self, url: str) -> int | None:
        """HTTP status of GET `url` as the admin, None when nothing answers."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        request = urllib.request.Request(
            url, headers={"Authorization": f"Bearer {self.users[credentials.ADMIN_USER].token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as response:
                return response.status
        except urllib.error.HTTPError as error:
            return error.code
        except (urllib.error.URLError, OSError):
            return None

    # ----- clients ---------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG, for processes (kubectl, the operator) run against it."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KUBECACHEDIR": str(self.workdir / "kube-cache")}

    def kubectl(
        self,
        *args: str,
        user: str = credentials.ADMIN_USER,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess:
        """Run kubectl as `user` (a context of the kubeconfig); raises KubectlError on failure
        unless `check` is False. `input` is fed to stdin (for `-f -`)."""
        argv = [str(self.binaries.kubectl), f"--context={user}", *args]
        result = subprocess.run(argv, env=self.env, input=input, text=True, timeout=timeout, capture_output=True)
        if check and result.returncode != 0:
            raise KubectlError(args, result.returncode, result.stderr)
        return result

    def kubectl_json(self, *args: str, user: str = credentials.ADMIN_USER) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json", user=user).stdout)

    def api_client(self, user: str = credentials.ADMIN_USER):
        """A kubernetes.client.ApiClient authenticated as `user`."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig), context=user)

    # ----- objects ---------------------------------------------------------------------------

    def _wait_service_account(self, namespace: str, timeout: float = 60.0) -> None:
        # 1.20 admits a pod only once the namespace's `default` service account has its token
        # secret (made by the controller manager).
        def ready() -> bool:
            result = self.kubectl(
                "get", "serviceaccount", "default", "-n", namespace, "-o", "jsonpath={.secrets[0].name}", check=False
            )
            return result.returncode == 0 and bool(result.stdout.strip())

        wait_for(f"service account default/{namespace} with a token", ready, timeout=timeout, check=self._check_running)

    def create_namespace(self, name: str, *, labels: Mapping[str, str] | None = None) -> None:
        """Create a namespace and wait until pods can be created in it."""
        manifest = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": dict(labels or {})}}
        self.kubectl("create", "-f", "-", input=json.dumps(manifest))
        self._wait_service_account(name)

    def create_node(
        self,
        name: str,
        *,
        device_resource: str | None = nodes.DEFAULT_DEVICE_RESOURCE,
        devices: int = 8,
        labels: Mapping[str, str] | None = None,
        taints: list[dict] | None = None,
        cpu: str = "64",
        memory: str = "512Gi",
        max_pods: int = 110,
    ) -> dict:
        """Create a Ready emulated node with `devices` of `device_resource` and the Ascend labels.

        The status is written through the status subresource (a create drops it). The
        TaintNodesByCondition admission plugin taints every new node not-ready; the node
        lifecycle controller that would lift it once Ready needs kubelets and is off, so we set
        the taints to `taints` ourselves. Returns the Node as the apiserver stored it.
        """
        from kubernetes import client

        merge_patch = "application/merge-patch+json"
        api = client.CoreV1Api(self.api_client())
        try:
            api.create_node(nodes.node_manifest(name, labels=labels, taints=taints))
            status = nodes.node_status(
                name, device_resource=device_resource, num_devices=devices, cpu=cpu, memory=memory, max_pods=max_pods
            )
            api.patch_node_status(name, {"status": status}, _content_type=merge_patch)
            node = api.patch_node(
                name, {"spec": {"taints": list(taints) if taints else None}}, _content_type=merge_patch
            )
            return api.api_client.sanitize_for_serialization(node)
        finally:
            api.api_client.close()

    def install_crd(self, path: Path | str, *, timeout: float = 60.0) -> list[str]:
        """`kubectl create` (or replace, when present) the CRDs in `path`; wait until Established.

        Raises KubectlError carrying the apiserver's refusal verbatim.
        """
        path = Path(path)
        result = self.kubectl("create", "-f", str(path), check=False)
        if result.returncode != 0:
            if "AlreadyExists" not in result.stderr:
                raise KubectlError(("create", "-f", str(path)), result.returncode, result.stderr)
            self.kubectl("replace", "-f", str(path))
        names = [doc["metadata"]["name"] for doc in crds.load_documents(path)]
        for name in names:
            self.wait_crd_established(name, timeout=timeout)
        return names

    def wait_crd_established(self, name: str, *, timeout: float = 60.0) -> None:
        # Not `kubectl wait`: kubectl 1.32 fails instead of waiting while status.conditions
        # is still absent, as it is right after the create.
        def established() -> bool:
            crd = self.kubectl_json("get", "crd", name)
            return any(
                c["type"] == "Established" and c["status"] == "True"
                for c in crd.get("status", {}).get("conditions") or []
            )

        wait_for(f"CRD {name} Established", established, timeout=timeout, check=self._check_running)

    def install_kuberay_crds(self, path: Path | str = crds.KUBERAY_CRD_DIR) -> list[str]:
        """Install KubeRay's own CRDs from `path` (a folder of *.yaml or one file), with only the
        edits a 1.20 apiserver needs (crds.downgrade_for_1_20). Returns the CRD names."""
        path = Path(path)
        files = [path] if path.is_file() else crds.kuberay_crd_files(path)
        out_dir = self.workdir / "crds"
        out_dir.mkdir(exist_ok=True)
        names = []
        for file in files:
            docs = [crds.downgrade_for_1_20(doc) for doc in crds.load_documents(file)]
            edited = out_dir / file.name
            edited.write_text(crds.dump_documents(docs))
            names += self.install_crd(edited)
        return names
