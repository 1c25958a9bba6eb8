"""The rldock operator against the test control plane, two ways:

- ChartOperator: deployed from the Helm chart (helm/rldock rendered with helm_python, applied with
  kubectl): the Deployment's pod is run by the node agent double, in-cluster credentials included;
  what the e2e scenarios use when the chart and helm_python are there;
- OperatorProcess: `python -m rldock.operator -n <namespace>` as a local process with a kubeconfig
  holding the token of a ServiceAccount that has exactly the Role builders/rbac.py generates.

The chart's operator reaches each Ray head's Jobs API as in a cluster, by the head Service's DNS name
(the node agent double's cluster DNS); the local process, outside the pod network's DNS, at the head
pod's IP (`--dashboard-address pod-ip`), which the node agent double makes a real address.
"""

from __future__ import annotations

import base64
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from kubernetes import client

from rldock.operator.builders.rbac import build_rbac, service_account_subject
from rldock_e2e.controlplane import ControlPlane, wait_for
from rldock_e2e.controlplane.processes import ManagedProcess
from rldock_e2e.repo import CHART_DIR

SERVICE_ACCOUNT = "rldock-operator"
# Seconds for one Ray Jobs API request (the chart's operator.rayTimeout, 5 by default). A Ray head
# on two shared cores under a full load can take longer than 5 s to answer a submission it then
# carries out; the operator would find the job running in its next round but never tell of the
# submission (no SubmittedRayJob event), which the scenarios check.
RAY_TIMEOUT = 30.0
# The key the test operators derive Ray job tokens from (never a real cluster's).
TEST_TOKEN_KEY = "rldock-e2e-test-token-key-0123456789abcdef"


def service_account_kubeconfig(plane: ControlPlane, namespace: str, path: Path, *, name: str = SERVICE_ACCOUNT) -> Path:
    """Create ServiceAccount `name` in `namespace` with the operator's Role there, and write a
    kubeconfig at `path` that authenticates with its token (1.20: the token Secret)."""
    plane.kubectl("create", "serviceaccount", name, "-n", namespace)
    for manifest in build_rbac(name=name, namespaces=[namespace], subject=service_account_subject(name, namespace)):
        plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    with plane.api_client() as api:
        core = client.CoreV1Api(api)
        secret_name = wait_for(
            f"the token of service account {name}",
            lambda: next(
                iter(s.name for s in core.read_namespaced_service_account(name, namespace).secrets or ()), None
            ),
            timeout=60,
        )
        token = base64.b64decode(core.read_namespaced_secret(secret_name, namespace).data["token"]).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": name,
        "clusters": [{"name": "e2e", "cluster": {"server": plane.server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": name, "context": {"cluster": "e2e", "user": name, "namespace": namespace}}],
    }
    path.write_text(yaml.safe_dump(config))
    return path


class LeaseArgs(NamedTuple):
    """Leader election of an OperatorProcess: the Lease `name` in `namespace`, held as `identity`."""

    namespace: str
    identity: str
    name: str = "rldock-operator"


class OperatorProcess:
    """`python -m rldock.operator` as its own process group; its log is `<log_dir>/operator.log`.

    With `lease`, it runs with leader election (only while it holds the Lease); with `health_port`,
    it serves /metrics, /healthz and /readyz there on the loopback address (`metrics_url`)."""

    def __init__(
        self,
        *,
        namespaces: Sequence[str],
        kubeconfig: Path,
        log_dir: Path,
        poll_interval: float = 1.0,
        ray_timeout: float = RAY_TIMEOUT,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        lease: LeaseArgs | None = None,
        health_port: int | None = None,
    ) -> None:
        election = (
            [
                "--leader-election",
                "--lease-namespace",
                lease.namespace,
                "--lease-name",
                lease.name,
                "--identity",
                lease.identity,
            ]
            if lease is not None
            else []
        )
        self.health_port = health_port
        self.argv = [
            sys.executable,
            "-m",
            "rldock.operator",
            *[a for ns in namespaces for a in ("-n", ns)],
            "--poll-interval",
            str(poll_interval),
            "--dashboard-address",
            "pod-ip",
            "--ray-timeout",
            str(ray_timeout),
            "--log-level",
            os.environ.get("RLDOCK_OPERATOR_LOG_LEVEL", "INFO"),
            *election,
            *(["--health-port", str(health_port)] if health_port is not None else []),
            *extra_args,
        ]
        # The test kubeconfig skips TLS verification; urllib3 would warn on every request.
        self.env = {
            **(os.environ if env is None else env),
            "KUBECONFIG": str(kubeconfig),
            "PYTHONUNBUFFERED": "1",
            "PYTHONWARNINGS": "ignore:Unverified HTTPS request",
        }
        # Every replica of one test must derive the same Ray job tokens (settings.py RLDOCK_TOKEN_KEY).
        self.env.setdefault("RLDOCK_TOKEN_KEY", TEST_TOKEN_KEY)
        self.log_path = log_dir / "operator.log"
        self.process: ManagedProcess | None = None
        self.starts = 0

    def start(self) -> None:
        # Not from the repository root: there, folder operator/src/rldock/operator/ would shadow the standard library's
        # `operator` for `python -m`.
        self.process = ManagedProcess(
            "rldock-operator", self.argv, log_path=self.log_path, env=self.env, cwd=self.log_path.parent
        )
        self.starts += 1

    def kill(self) -> int:
        """SIGKILL, no cleanup, as when the operator's pod is evicted; returns the dead pid."""
        assert self.process is not None
        pid = self.process.pid
        os.killpg(pid, signal.SIGKILL)
        self.process.stop(timeout=5)
        self.process = None
        return pid

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def check(self) -> None:
        """Raise when the operator died on its own."""
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"the operator exited; its log ends:\n{self.log_tail(40)}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    @property
    def metrics_url(self) -> str:
        assert self.health_port is not None, "started without a health port"
        return f"http://127.0.0.1:{self.health_port}/metrics"


CHART = CHART_DIR
RELEASE = "rldock"


def chart_available() -> str | None:
    """None when the operator can be deployed from helm/rldock here, else why not."""
    if not (CHART / "Chart.yaml").is_file():
        return f"no chart at {CHART}"
    try:
        import helm_python  # noqa: F401  (renders the chart without a helm binary)
    except ImportError:
        return "helm_python (the Helm library's Python binding) is not installed"
    return None


def render_operator_chart(namespace: str, *, poll_interval: float = 1.0) -> list[dict[str, Any]]:
    """What `helm template rldock helm/rldock -n <namespace>` renders for an operator watching
    `namespace`, otherwise with the chart's defaults (it reaches Ray heads by their Services' DNS
    names, which the cluster DNS double resolves in pods); the CRD is left out (the session
    installs it once). One replica (ChartOperator follows one pod; it still runs with leader
    election, and its container, restarted after a kill, takes its own Lease back at once: the
    identity is the pod name) and no PodDisruptionBudget (the chart renders policy/v1 when it
    cannot ask the cluster, which Kubernetes 1.20 does not serve)."""
    import helm_python as helm

    values = {
        "operator": {
            "watchNamespaces": [namespace],
            "pollInterval": poll_interval,
            "rayTimeout": RAY_TIMEOUT,
            "logLevel": os.environ.get("RLDOCK_OPERATOR_LOG_LEVEL", "INFO"),
        },
        "crds": {"install": False},
        "replicaCount": 1,
        "podDisruptionBudget": {"enabled": False},
    }
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=RELEASE, namespace=namespace, is_install=True)
    return [
        doc
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc and doc["kind"] != "CustomResourceDefinition"
    ]


class ChartOperator:
    """The operator as the Helm chart deploys it: the rendered ServiceAccount, Role, RoleBinding and
    Deployment applied to the control plane; the real ReplicaSet controller and scheduler make and
    place its pod, and the node agent double runs the Deployment's command (`python -m
    rldock.operator`, settings from the chart's RLDOCK_* env) with the ServiceAccount's in-cluster
    credentials. Same interface as OperatorProcess."""

    def __init__(self, plane: ControlPlane, *, namespace: str, agent: Any, poll_interval: float = 1.0) -> None:
        self.plane, self.namespace, self.agent = plane, namespace, agent
        self.objects = render_operator_chart(namespace, poll_interval=poll_interval)
        (deployment,) = [o for o in self.objects if o["kind"] == "Deployment"]
        self.deployment = deployment["metadata"]["name"]
        self.selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
        self.container = deployment["spec"]["template"]["spec"]["containers"][0]["name"]
        self.kills = 0
        self.deployed = False

    @property
    def process(self) -> int | None:  # as OperatorProcess.process: None once stopped
        return self.pid() if self.deployed else None

    def start(self) -> None:
        if not self.deployed:
            self.plane.kubectl("apply", "-n", self.namespace, "-f", "-", input=yaml.safe_dump_all(self.objects))
            self.deployed = True
        wait_for("the operator pod ready", self._ready, timeout=180, interval=1, check=self.check)

    def pod(self) -> dict[str, Any] | None:
        pods = self.plane.kubectl_json("get", "pods", "-n", self.namespace, "-l", self.selector)["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live[0] if live else None

    def pid(self) -> int | None:
        pod = self.pod()
        return self.agent.container_pid(self.namespace, pod["metadata"]["name"], self.container) if pod else None

    def _ready(self) -> bool:
        pod = self.pod()
        return bool(pod) and any(
            c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or ()
        )

    def kill(self) -> int:
        """SIGKILL the operator's process, as the OOM killer would: its kubelet restarts the
        container (restartPolicy Always, after the back-off); returns the dead pid."""
        pid = self.pid()
        assert pid is not None, "the operator is not running"
        os.kill(pid, signal.SIGKILL)
        self.kills += 1
        return pid

    def stop(self) -> None:
        if self.deployed:
            self.plane.kubectl(
                "delete", "deployment", self.deployment, "-n", self.namespace, "--wait=false", check=False
            )
            self.deployed = False

    def restarts(self) -> int:
        pod = self.pod()
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or ()
        return sum(s.get("restartCount", 0) for s in statuses)

    def check(self) -> None:
        """Raise when the operator restarted more often than it was killed (it crashed)."""
        if self.deployed and self.restarts() > self.kills:
            raise AssertionError(f"the operator pod restarted on its own; its log ends:\n{self.log_tail(40)}")

    def log_tail(self, lines: int = 40) -> str:
        pod = self.pod()
        if pod is None:
            return ""
        path = self.agent.log_path(self.namespace, pod["metadata"]["name"], self.container)
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""
