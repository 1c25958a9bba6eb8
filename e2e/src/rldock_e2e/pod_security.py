"""A checker of the `restricted` Pod Security Standard, written from the standard's published text
(kubernetes.io/docs/concepts/security/pod-security-standards/, policy version "latest"), not from
rldock's builders: the tests hold every pod template the operator builds against it.

Kubernetes 1.20, the test control plane, has no Pod Security admission (it came in 1.23), so this
stands in for `pod-security.kubernetes.io/enforce: restricted` on a namespace. It checks a pod
spec (or a template's spec) with the pod's annotations, and returns one line per violation, named
by the control as the standard names it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

# Baseline: capabilities a container may add.
BASELINE_CAPABILITIES = frozenset(
    {
        "AUDIT_WRITE",
        "CHOWN",
        "DAC_OVERRIDE",
        "FOWNER",
        "FSETID",
        "KILL",
        "MKNOD",
        "NET_BIND_SERVICE",
        "SETFCAP",
        "SETGID",
        "SETPCAP",
        "SETUID",
        "SYS_CHROOT",
    }
)
# Baseline: the "safe" sysctls.
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"
# Restricted: the only volume sources.
RESTRICTED_VOLUMES = frozenset(
    {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}
)


def _containers(spec: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for field in ("containers", "initContainers", "ephemeralContainers"):
        for container in spec.get(field) or ():
            yield f"{field}[{container.get('name')}]", container


def restricted_violations(spec: Mapping[str, Any], annotations: Mapping[str, str] | None = None) -> list[str]:
    """Every way the pod `spec` (with its `annotations`) breaks the baseline or restricted profile."""
    problems: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    containers = list(_containers(spec))

    # --- baseline ---
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess") or any(
        ((c.get("securityContext") or {}).get("windowsOptions") or {}).get("hostProcess") for _, c in containers
    ):
        problems.append("HostProcess: hostProcess must be unset or false")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            problems.append(f"Host Namespaces: {field} must be unset or false")
    for where, container in containers:
        sc = container.get("securityContext") or {}
        if sc.get("privileged"):
            problems.append(f"Privileged Containers: {where}.securityContext.privileged must be unset or false")
        added = set((sc.get("capabilities") or {}).get("add") or ())
        if added - BASELINE_CAPABILITIES:
            problems.append(f"Capabilities (baseline): {where} adds {sorted(added - BASELINE_CAPABILITIES)}")
        for port in container.get("ports") or ():
            if port.get("hostPort"):
                problems.append(f"Host Ports: {where} uses hostPort {port['hostPort']}")
        if sc.get("procMount") not in (None, "Default"):
            problems.append(f"/proc Mount Type: {where}.securityContext.procMount must be Default")
    for volume in spec.get("volumes") or ():
        if "hostPath" in volume:
            problems.append(f"HostPath Volumes: volume {volume.get('name')!r} is a hostPath")
    for key, value in (annotations or {}).items():
        if key.startswith(APPARMOR_ANNOTATION) and value != "runtime/default" and not value.startswith("localhost/"):
            problems.append(f"AppArmor: {key}={value}")
    contexts = [("pod", pod_sc)] + [(where, c.get("securityContext") or {}) for where, c in containers]
    for where, sc in contexts:
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            problems.append(f"AppArmor: {where}.securityContext.appArmorProfile.type")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            problems.append(f"SELinux: {where}.securityContext.seLinuxOptions {selinux}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            problems.append(f"Seccomp (baseline): {where}.securityContext.seccompProfile.type is Unconfined")
        if where != "pod" and sc.get("runAsUser") == 0:
            problems.append(f"Running as Non-root user: {where}.securityContext.runAsUser is 0")
    for sysctl in pod_sc.get("sysctls") or ():
        if sysctl.get("name") not in SAFE_SYSCTLS:
            problems.append(f"Sysctls: {sysctl.get('name')} is not a safe sysctl")

    # --- restricted ---
    for volume in spec.get("volumes") or ():
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            problems.append(f"Volume Types: volume {volume.get('name')!r} is {sorted(kinds - RESTRICTED_VOLUMES)}")
    if pod_sc.get("runAsUser") == 0:
        problems.append("Running as Non-root user: pod securityContext.runAsUser is 0")
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    for where, container in containers:
        sc = container.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"Privilege Escalation: {where}.securityContext.allowPrivilegeEscalation must be false")
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        if non_root is not True:
            problems.append(f"Running as Non-root: {where} must run with runAsNonRoot true (pod or container)")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"Seccomp: {where} needs seccompProfile RuntimeDefault or Localhost (pod or container)")
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or ()):
            problems.append(f"Capabilities: {where} must drop ALL")
        if set(capabilities.get("add") or ()) - {"NET_BIND_SERVICE"}:
            problems.append(f"Capabilities: {where} may add only NET_BIND_SERVICE")
    return problems
