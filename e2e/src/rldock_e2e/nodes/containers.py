"""A pod's containers as its kind-style node's containerd sees them: what `crictl ps` and `crictl
stop` would show and do on a real node (Debian packages no crictl; the node image's `ctr`, in the
CRI plugin's `k8s.io` namespace, does the same job).

The scenarios use it where the node-agent double let them look at local processes: a container
SIGKILLed as by the OOM killer (the operator's crash), a released pod's containers checked
gone from its node, not just its API object, and what a container's processes really run as
(uids, capabilities, no_new_privs, seccomp from /proc/<pid>/status on the node).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .cluster import KindNodes

CRI_NAMESPACE = "k8s.io"  # containerd's namespace for the kubelet's containers
RUNTIME_PREFIX = "containerd://"  # status.containerStatuses[].containerID


def container_ids(pod: Mapping[str, Any]) -> dict[str, str]:
    """containerd's id of each container the kubelet has reported for `pod`, by container name."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or ()
    return {s["name"]: s["containerID"].removeprefix(RUNTIME_PREFIX) for s in statuses if s.get("containerID")}


def kill_container(nodes: KindNodes, pod: Mapping[str, Any], container: str, *, signal: str = "SIGKILL") -> str:
    """Send `signal` to `container`'s process in `pod` through its node's containerd, as the kernel
    or an OOM kill would (the kubelet only learns of it from the runtime); returns the container id."""
    ids = container_ids(pod)
    assert container in ids, f"pod {pod['metadata']['name']} has no started container {container!r}: {ids}"
    nodes.exec(pod["spec"]["nodeName"], "ctr", "-n", CRI_NAMESPACE, "tasks", "kill", "--signal", signal, ids[container])
    return ids[container]


def running_tasks(table: str) -> set[str]:
    """The ids of the RUNNING tasks in `ctr tasks ls`'s table (header `TASK PID STATUS`)."""
    rows = [line.split() for line in table.splitlines()[1:]]
    return {row[0] for row in rows if len(row) == 3 and row[2] == "RUNNING"}


def running_containers(nodes: KindNodes) -> set[str]:
    """The ids of every container with a running process on any of the nodes."""
    return set().union(
        *(running_tasks(nodes.exec(name, "ctr", "-n", CRI_NAMESPACE, "tasks", "ls")) for name in nodes.nodes)
    )


def task_pids(table: str) -> list[int]:
    """The process ids in `ctr tasks ps`'s table (header `PID INFO`)."""
    return [int(row.split()[0]) for row in table.splitlines()[1:] if row.split() and row.split()[0].isdigit()]


def parse_status(text: str) -> dict[str, str]:
    """/proc/<pid>/status as {field: value} (`Uid: 10001 10001 10001 10001` -> "10001 10001 ...")."""
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines()) if value}


# /proc/<pid>/status of each pid given, in one exec; `---` separates the files. A pid that ended
# since `ctr tasks ps` listed it prints nothing, and the script still exits 0: the loop's status is
# its last command's, and a vanished last pid made the whole read fail (seen once, a Ray worker).
STATUS_SCRIPT = 'for p in "$@"; do echo "--- $p"; cat "/proc/$p/status" 2>/dev/null || true; done'


def container_processes(nodes: KindNodes, pod: Mapping[str, Any], container: str) -> dict[int, dict[str, str]]:
    """/proc/<pid>/status of every process of `container` in `pod`, as its node's kernel shows them
    (pid in the node's namespace -> parse_status), read through the node's containerd: what the
    pod's securityContext really gave the processes (uids, capability sets, no_new_privs, seccomp),
    not what its spec asked for. A process that ended between the listing and the read is left out."""
    ids = container_ids(pod)
    assert container in ids, f"pod {pod['metadata']['name']} has no started container {container!r}: {ids}"
    node = pod["spec"]["nodeName"]
    pids = task_pids(nodes.exec(node, "ctr", "-n", CRI_NAMESPACE, "tasks", "ps", ids[container]))
    assert pids, f"container {container} of pod {pod['metadata']['name']} has no process"
    out = nodes.exec(node, "sh", "-c", STATUS_SCRIPT, "sh", *map(str, pids))
    statuses: dict[int, dict[str, str]] = {}
    for chunk in out.split("--- ")[1:]:
        pid, _, text = chunk.partition("\n")
        if text.strip():
            statuses[int(pid)] = parse_status(text)
    return statuses
