"""The operator installed the way docs/install.md installs it: a Helm release of helm/rldock,
through the Helm library (helm_python binds Helm's own install, upgrade and uninstall actions:
the code path of `helm install`, with release records in Secrets, hooks, ownership checks and
the CRD's keep policy), not rendered and applied. The chart is installed as it is in the checkout,
its vendored (and disabled) KubeRay subchart included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .controlplane import ControlPlane, credentials, wait_for
from .nodes.cluster import KindNodes
from .nodes.containers import kill_container
from .repo import CHART_DIR

RELEASE = "rldock"
# The documented namespace of the release (docs/install.md).
RELEASE_NAMESPACE = "rldock-system"


class HelmRelease:
    """`helm install/upgrade/uninstall rldock <chart> -n <namespace>` as the control plane's admin."""

    def __init__(
        self,
        plane: ControlPlane,
        chart: Path = CHART_DIR,
        *,
        namespace: str = RELEASE_NAMESPACE,
        name: str = RELEASE,
    ) -> None:
        import helm_python as helm

        self._helm = helm
        self.chart, self.namespace, self.name = chart, namespace, name
        self.config = helm.Config(
            kubeconfig_path=str(plane.kubeconfig), kube_context=credentials.ADMIN_USER, namespace=namespace
        )

    def install(self, values: dict[str, Any]) -> Any:
        with self._helm.Chart.load(self.chart) as chart:
            return self.config.install(
                chart, self.name, values, namespace=self.namespace, create_namespace=True, timeout=300
            )

    def upgrade(self, values: dict[str, Any]) -> Any:
        with self._helm.Chart.load(self.chart) as chart:
            return self.config.upgrade(chart, self.name, values, namespace=self.namespace, timeout=300)

    def uninstall(self) -> Any:
        return self.config.uninstall(self.name, timeout=300)

    def uninstall_if_present(self) -> None:
        """Uninstall the release when it exists (a test that failed midway left it installed, and
        the next test's install of the same name would be refused)."""
        try:
            self.config.status(self.name)
        except self._helm.HelmError as error:  # Helm's "release: not found", whichever class carries it
            if isinstance(error, self._helm.HelmNotFoundError) or "not found" in str(error):
                return
            raise
        self.uninstall()

    def history(self) -> list[Any]:
        return self.config.history(self.name)

    def close(self) -> None:
        self.config.close()


def diagnosis(plane: ControlPlane, namespace: str, selector: str, *, lines: int = 30) -> str:
    """The state of the pods matching `selector`, for a failed wait's message: phase, conditions,
    container states and restarts, the last log lines of each container, and the namespace's
    latest events (a pod that never started says why there)."""
    parts = []
    pods = plane.kubectl_json("get", "pods", "-n", namespace, "-l", selector)["items"]
    for pod in pods:
        name, status = pod["metadata"]["name"], pod.get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or ()}
        parts.append(f"pod {name} on {pod['spec'].get('nodeName')}: {status.get('phase')} {conditions}")
        for container in status.get("containerStatuses") or ():
            parts.append(
                f"  {container['name']}: restarts {container.get('restartCount')}, "
                f"state {container.get('state')}, last {container.get('lastState')}"
            )
            log = plane.kubectl("logs", "-n", namespace, name, "-c", container["name"], f"--tail={lines}", check=False)
            parts.append("  | " + (log.stdout + log.stderr).strip().replace("\n", "\n  | "))
    events = plane.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp", check=False).stdout
    parts.append("events:\n" + "\n".join(events.strip().splitlines()[-15:]))
    return "\n".join(parts) if pods else f"no pod matches {selector} in {namespace}\n{parts[-1]}"


class ReleasedOperator:
    """The operator of a Helm release, as the scenarios drive an operator (the interface of
    operator_process.ChartOperator): `start` installs the release and waits for its pod to be
    Ready, `stop` uninstalls it; its pod is run by a real kubelet, so there is no local pid.
    `nodes`: the kind-style nodes its pod runs on, which `kill` needs."""

    def __init__(
        self, plane: ControlPlane, release: HelmRelease, values: dict[str, Any], *, nodes: KindNodes | None = None
    ) -> None:
        self.plane, self.release, self.values, self.nodes = plane, release, values, nodes
        self.installed = False
        self.kills = 0

    @property
    def process(self) -> bool | None:  # as OperatorProcess.process: None once stopped
        return True if self.installed else None

    def start(self) -> None:
        if not self.installed:
            self.release.install(self.values)
            self.installed = True
        # After a kill, Ready again only counts once its kubelet has restarted the container.
        try:
            wait_for(
                "the operator pod ready",
                lambda: self.restarts() >= self.kills and self._ready(),
                timeout=300,
                interval=1,
                check=self.check,
            )
        except TimeoutError as error:
            raise TimeoutError(f"{error}\n{self.diagnosis()}") from None

    def diagnosis(self) -> str:
        return diagnosis(self.plane, self.release.namespace, f"app.kubernetes.io/instance={self.release.name}")

    def kill(self) -> str:
        """SIGKILL the operator's process through its node's containerd, as the OOM killer would:
        its kubelet restarts the container (restartPolicy Always); returns the killed container's id."""
        assert self.nodes is not None, "killing the operator needs the nodes it runs on"
        pod = self.pod()
        assert pod is not None, "the operator is not running"
        killed = kill_container(self.nodes, pod, pod["spec"]["containers"][0]["name"])
        self.kills += 1
        return killed

    def stop(self) -> None:
        if self.installed:
            self.release.uninstall()
            self.installed = False

    def pod(self) -> dict[str, Any] | None:
        pods = self.plane.kubectl_json(
            "get", "pods", "-n", self.release.namespace, "-l", f"app.kubernetes.io/instance={self.release.name}"
        )["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        return live[0] if live else None

    def _ready(self) -> bool:
        pod = self.pod()
        return bool(pod) and any(
            c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or ()
        )

    def restarts(self) -> int:
        statuses = ((self.pod() or {}).get("status") or {}).get("containerStatuses") or ()
        return sum(s.get("restartCount", 0) for s in statuses)

    def check(self) -> None:
        """Raise when the operator's container restarted more often than `kill` killed it (it crashed)."""
        if self.installed and self.restarts() > self.kills:
            raise AssertionError(f"the operator pod restarted on its own; its log ends:\n{self.log_tail(40)}")

    def log_tail(self, lines: int = 40) -> str:
        pod = self.pod()
        if pod is None:
            return ""
        result = self.plane.kubectl(
            "logs", "-n", self.release.namespace, pod["metadata"]["name"], f"--tail={lines}", check=False
        )
        return result.stdout + result.stderr
