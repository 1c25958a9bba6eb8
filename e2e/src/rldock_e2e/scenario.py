"""One e2e scenario's namespace as a user sees it through kubectl, with what acts behind it.

The scenarios (tests/e2e/test_scenarios.py) assert on kubectl's output and on the files the job
writes to its checkpoint volume; the operator process, the KubeRay double and the node agent
double are only reached for their logs and for the local processes a pod runs. Waiting polls the
API with the Python client instead of kubectl: a kubectl process a second would cost a third of a
core on a two-core machine.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client

from rldock.operator.constants import AUTH_SECRET_KEY, DASHBOARD_PORT, LABEL_RAY_CLUSTER, LABEL_RLJOB
from rldock.operator.rayjobs import RayJobsClient, RayJobsError
from rldock.runtime.driver.iteration_hold import HOLD_FILE_ENV
from rldock_e2e.controlplane import ControlPlane, wait_for
from rldock_e2e.doubles.kuberay import KubeRayDouble
from rldock_e2e.doubles.node_agent import NodeAgentDouble
from rldock_e2e.doubles.sandbox import pids_in_namespace

T = TypeVar("T")
RAY_POD = {"ray.io/is-ray-node": "yes"}  # KubeRay's label on head and worker pods


class Scenario:
    def __init__(
        self,
        *,
        plane: ControlPlane,
        namespace: str,
        agent: NodeAgentDouble | None,
        kuberay: KubeRayDouble,
        operator: Any,
        api: client.ApiClient,
        host_root: Path | None = None,
        doubles: Sequence[Any] = (),
    ) -> None:
        """`agent`: the node agent double running the pods, None on real kubelets (kind-style
        nodes), where `host_root` is the host folder standing for the nodes' `/` in hostPath
        volumes (their shared storage). `operator`: an OperatorProcess, ChartOperator or
        helm_release.ReleasedOperator. `doubles`: more test doubles whose `.errors` fail the scenario."""
        self.plane, self.namespace = plane, namespace
        self.agent, self.kuberay, self.operator = agent, kuberay, operator
        if host_root is None:
            assert agent is not None, "without the node agent double, say where the shared storage is (host_root)"
            host_root = agent.host_root
        self.host_root = host_root
        self._doubles = [d for d in (agent, kuberay, *doubles) if d is not None]
        self._custom = client.CustomObjectsApi(api)
        self._core = client.CoreV1Api(api)

    # ----- kubectl ------------------------------------------------------------------------------
    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        return self.plane.kubectl(*args, "-n", self.namespace, check=check, input=input)

    def get(self, kind: str, name: str) -> dict[str, Any] | None:
        """`kubectl get <kind> <name> -o json`, None when it does not exist."""
        result = self.kubectl("get", kind, name, "-o", "json", check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr:
                return None
            raise AssertionError(f"kubectl get {kind} {name}: {result.stderr}")
        return json.loads(result.stdout)

    def items(self, kind: str, *selector: str) -> list[dict[str, Any]]:
        """`kubectl get <kind> [-l ...] -o json`'s items."""
        return json.loads(self.kubectl("get", kind, *selector, "-o", "json").stdout)["items"]

    def status(self, name: str) -> dict[str, Any]:
        """The RLJob's status (through the API: for polling; assert on `row` and `get`)."""
        try:
            job = self._custom.get_namespaced_custom_object("rldock.io", "v1alpha1", self.namespace, "rljobs", name)
        except client.ApiException as error:
            if error.status == 404:
                return {}
            raise
        return job.get("status") or {}

    def pods_now(self, selector: str = "") -> list[dict[str, Any]]:
        """The namespace's pods (through the API: for polling)."""
        return json.loads(
            self._core.list_namespaced_pod(self.namespace, label_selector=selector, _preload_content=False).data
        )["items"]

    def row(self, name: str) -> dict[str, str]:
        """`kubectl get rljob <name>` as the user reads it: column -> value ("" for an empty cell:
        kubectl leaves a number column without a value blank, so the row is cut at the header's
        column starts, not split on spaces)."""
        header, line = self.kubectl("get", "rljob", name).stdout.splitlines()[:2]
        starts = [match.start() for match in re.finditer(r"\S+", header)]
        ends = [*starts[1:], None]
        return {header.split()[i]: line[start:end].strip() for i, (start, end) in enumerate(zip(starts, ends))}

    def condition(self, name: str, type_: str) -> dict[str, Any] | None:
        status = (self.get("rljob", name) or {}).get("status") or {}
        return next((c for c in status.get("conditions") or () if c["type"] == type_), None)

    def events(self, name: str) -> list[dict[str, Any]]:
        return self.items("events", f"--field-selector=involvedObject.name={name}")

    def ray_pods(self, cluster: str) -> list[dict[str, Any]]:
        return self.items("pods", "-l", f"ray.io/cluster={cluster}")

    def driver_log(self, name: str) -> str:
        """The driver's log of the RLJob's current Ray job so far, as `ray job logs` shows it: the
        head's Jobs API (at its pod IP, which the host reaches on the bridge) with the token of the
        RLJob's Secret. Empty while there is no Ray job or no running head, or the head does not answer
        (a dashboard on two loaded cores can miss a poll; the caller polls again)."""
        submission = self.status(name).get("rayJobId")
        heads = [
            p
            for p in self.pods_now(f"{LABEL_RAY_CLUSTER}={name},ray.io/node-type=head")
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
        ]
        secrets = self._core.list_namespaced_secret(self.namespace, label_selector=f"{LABEL_RLJOB}={name}").items
        if not submission or not heads or not secrets:
            return ""
        token = base64.b64decode(secrets[0].data[AUTH_SECRET_KEY]).decode()
        jobs = RayJobsClient(f"http://{heads[0]['status']['podIP']}:{DASHBOARD_PORT}", token=token, timeout=30)
        try:
            return jobs.get_logs(submission)
        except RayJobsError:
            return ""

    # ----- waiting ------------------------------------------------------------------------------
    def check(self) -> None:
        """Fail fast when something behind the scenario broke."""
        self.operator.check()
        for double in self._doubles:
            if double.errors:
                raise AssertionError(f"{type(double).__name__} failed: {double.errors[-1]!r}")

    def wait(self, what: str, probe: Callable[[], T], *, timeout: float, interval: float = 2.0) -> T:
        try:
            return wait_for(what, probe, timeout=timeout, interval=interval, check=self.check)
        except TimeoutError:
            raise AssertionError(f"{what}: timed out after {timeout:.0f} s\n{self.report()}") from None

    def wait_phase(self, name: str, phases: Sequence[str] | str, *, timeout: float) -> dict[str, Any]:
        wanted = (phases,) if isinstance(phases, str) else tuple(phases)
        return self.wait(
            f"RLJob {name} in phase {'/'.join(wanted)}",
            lambda: (s := self.status(name)).get("phase") in wanted and s,
            timeout=timeout,
        )

    def report(self) -> str:
        """What a user would look at when a scenario is stuck, plus the operator's log."""
        parts = []
        for args in (("get", "rljobs,rayclusters,pods", "-o", "wide"), ("get", "events", "--sort-by=.lastTimestamp")):
            result = self.kubectl(*args, check=False)
            parts.append(f"$ kubectl {' '.join(args)}\n{result.stdout}{result.stderr}")
        parts.append(f"operator log (tail):\n{self.operator.log_tail(30)}")
        return "\n".join(parts)

    # ----- the job's files and processes --------------------------------------------------------
    def output_dir(self, name: str) -> Path:
        """The job's output as the host sees it: <volume>/<namespace>/<name>/<uid>, the volume being
        the claim's (or hostPath's) folder on the nodes' shared storage."""
        rljob = self.get("rljob", name) or {}
        checkpoint = rljob["spec"]["checkpoint"]
        volume = self.host_root / checkpoint["hostPath"].lstrip("/") if "hostPath" in checkpoint else None
        volume = volume or self.claim_dir(checkpoint["claimName"])
        return volume / self.namespace / name / rljob["metadata"]["uid"]

    def claim_dir(self, claim: str) -> Path:
        """The host folder of a claim bound to a hostPath volume on the nodes' shared storage."""
        bound = self.get("pvc", claim)
        assert bound is not None, f"no claim {claim} in {self.namespace}"
        volume_name = bound["spec"]["volumeName"]
        host_path = self.plane.kubectl_json("get", "pv", volume_name)["spec"]["hostPath"]["path"]
        return self.host_root / host_path.lstrip("/")

    def hold(self, name: str, *, claim: str, mount_path: str = "/checkpoints") -> JobHold:
        """A hold for RLJob `name` (not yet applied) on the checkpoint volume `claim`, which its pods
        mount at `mount_path`: put `hold.env` in its spec.env (runtime/driver/iteration_hold.py)."""
        return JobHold(self.claim_dir(claim), mount_path, name=f"{self.namespace}-{name}")

    def metrics(self, name: str) -> list[dict[str, Any]]:
        path = self.output_dir(name) / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    def processes(self) -> dict[str, list[int]]:
        """The live local processes of this namespace's Ray pods, by pod name."""
        return {pod: pids for pod, pids in self.agent.pids(self.namespace, labels=RAY_POD).items() if pids}

    def pod_namespaces(self) -> dict[str, int]:
        """The UTS namespace of every Ray pod running now, by pod name: what `leftovers` checks."""
        return self.agent.uts_namespaces(self.namespace, labels=RAY_POD)

    @staticmethod
    def leftovers(namespaces: dict[str, int]) -> dict[str, list[int]]:
        """Processes still alive in any of these pods' namespaces (none, once the pods are gone)."""
        return {pod: pids for pod, inode in namespaces.items() if (pids := pids_in_namespace("uts", inode))}


class JobHold:
    """The test's end of the runtime's hold (runtime/driver/iteration_hold.py): a file at the root of the
    job's checkpoint volume, which the driver reads before each iteration while RLDOCK_TEST_HOLD_FILE
    names it. `before(n)`: iterations n and later wait; `release()`: the job runs on. So a scenario
    interrupts a job at an iteration it chose, not at one the job's speed left it."""

    def __init__(self, volume: Path, mount_path: str, *, name: str) -> None:
        file_name = f".rldock-test-hold-{name}"
        self.host_path = volume / file_name
        self.env = [{"name": HOLD_FILE_ENV, "value": f"{mount_path.rstrip('/')}/{file_name}"}]

    def before(self, iteration: int) -> JobHold:
        """Hold the job before `iteration` (it runs the earlier ones); written whole (a rename), and
        readable by the pods' non-root user."""
        self.host_path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.host_path.with_name(self.host_path.name + ".partial")
        partial.write_text(f"{iteration}\n")
        partial.chmod(0o644)
        os.replace(partial, self.host_path)
        return self

    def release(self) -> None:
        self.host_path.unlink(missing_ok=True)


def sample(every: float, until: Callable[[], bool], take: Callable[[], T], *, timeout: float) -> list[T]:
    """`take()` every `every` s until `until()` holds (or `timeout`), returning what was taken."""
    taken, deadline = [], time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done within {timeout:.0f} s")
        taken.append(take())
        time.sleep(every)
    return taken


def checkpoint_iteration(status: dict[str, Any]) -> int:
    """`status.lastCheckpoint` (.../checkpoints/iter-000008) as an iteration number; 0 when none."""
    last = status.get("lastCheckpoint") or ""
    return int(last.rsplit("iter-", 1)[1]) if "iter-" in last else 0


def assert_resumed(
    final: list[dict[str, Any]], before: list[dict[str, Any]], *, checkpoint: int, iterations: int
) -> None:
    """Every iteration's metrics exactly once, and those up to the checkpoint the interruption left
    are the very records written before it (kept, not recomputed from scratch)."""
    assert [m["iteration"] for m in final] == list(range(1, iterations + 1)), [m["iteration"] for m in final]
    assert checkpoint >= 1 and final[:checkpoint] == before[:checkpoint], (checkpoint, final[:checkpoint])
