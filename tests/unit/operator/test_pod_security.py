"""Every Ray pod template the operator builds passes the `restricted` Pod Security Standard, held
against a checker written from the standard's text (rldock_e2e.pod_security), which is itself
checked against the standard's own examples of what each control refuses."""

from __future__ import annotations

import copy

import pytest
from rljob_testing import spec_dict

from rldock.operator.api import PodDefaults, RLJobSpec
from rldock.operator.builders import RLJobRef, build_ray_cluster
from rldock_e2e.pod_security import restricted_violations

JOB = RLJobRef(name="grpo", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")
ADMIN = PodDefaults(
    labels={"team": "ml"},
    annotations={"cost-center": "42"},
    priority_class_name="research",
    image_pull_secrets=("registry",),
)

# What a researcher can ask for without the admin's say: the templates must stay restricted.
VARIANTS = {
    "default": {},
    "inputs": {
        "volumes": [
            {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
            {"name": "reward", "configMap": {"name": "reward-code"}},
            {"name": "token", "secret": {"secretName": "hf"}},
            {"name": "scratch", "emptyDir": {"medium": "Memory"}},
        ],
        "volumeMounts": [{"name": n, "mountPath": f"/{n}"} for n in ("models", "reward", "token", "scratch")],
        "env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
        "imagePullSecrets": [{"name": "mine"}],
    },
    "kueue": {"scheduling": {"gang": "kueue", "queue": "q"}},
    "placed": {
        "cluster": {
            "nodeSelector": {"accelerator": "ascend"},
            "tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists"}],
        }
    },
}


def _templates(cluster: dict) -> list[dict]:
    return [
        cluster["spec"]["headGroupSpec"]["template"],
        *(group["template"] for group in cluster["spec"]["workerGroupSpecs"]),
    ]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("defaults", [PodDefaults(), ADMIN], ids=["installation", "admin-defaults"])
def test_every_ray_pod_template_is_restricted(variant, defaults):
    spec = RLJobSpec.model_validate(spec_dict(**VARIANTS[variant]))
    for template in _templates(build_ray_cluster(job=JOB, spec=spec, defaults=defaults)):
        assert restricted_violations(template["spec"], template["metadata"].get("annotations")) == []
        assert template["spec"]["automountServiceAccountToken"] is False


def test_the_admins_pod_defaults_reach_every_pod_and_the_operators_labels_win():
    spec = RLJobSpec.model_validate(spec_dict(imagePullSecrets=[{"name": "mine"}, {"name": "registry"}]))
    defaults = PodDefaults(
        labels={"team": "ml", "rldock.io/rljob": "spoofed"},
        annotations={"cost-center": "42"},
        priority_class_name="research",
        image_pull_secrets=("registry",),
    )
    for template in _templates(build_ray_cluster(job=JOB, spec=spec, defaults=defaults)):
        assert template["metadata"]["labels"]["team"] == "ml"
        assert template["metadata"]["labels"]["rldock.io/rljob"] == JOB.name
        assert template["metadata"]["annotations"] == {"cost-center": "42"}
        assert template["spec"]["priorityClassName"] == "research"
        assert template["spec"]["imagePullSecrets"] == [{"name": "registry"}, {"name": "mine"}]


def test_a_host_path_the_admin_allowed_leaves_the_restricted_profile():
    """Why hostPath needs the admin: the pod no longer passes `restricted` (docs/security.md)."""
    spec = RLJobSpec.model_validate(spec_dict(checkpoint={"hostPath": "/mnt/shared"}))
    template = _templates(build_ray_cluster(job=JOB, spec=spec))[0]
    violations = restricted_violations(template["spec"])
    assert [v.split(":")[0] for v in violations] == ["HostPath Volumes", "Volume Types"]


def _restricted_pod() -> dict:
    return copy.deepcopy(_templates(build_ray_cluster(job=JOB, spec=RLJobSpec.model_validate(spec_dict())))[0]["spec"])


def _set(pod: dict, path: str, value) -> dict:
    node = pod
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    node[leaf] = value
    return pod


# The standard's controls, one example each of a value it refuses.
REFUSED = {
    "HostProcess": ("securityContext.windowsOptions.hostProcess", True),
    "Host Namespaces": ("hostNetwork", True),
    "Privileged Containers": ("containers.0.securityContext.privileged", True),
    "Capabilities (baseline)": ("containers.0.securityContext.capabilities.add", ["SYS_ADMIN"]),
    "HostPath Volumes": ("volumes", [{"name": "root", "hostPath": {"path": "/"}}]),
    "Host Ports": ("containers.0.ports", [{"containerPort": 80, "hostPort": 80}]),
    "/proc Mount Type": ("containers.0.securityContext.procMount", "Unmasked"),
    "SELinux": ("securityContext.seLinuxOptions", {"type": "spc_t"}),
    "Sysctls": ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}]),
    "Volume Types": ("volumes", [{"name": "share", "nfs": {"server": "nfs", "path": "/"}}]),
    "Privilege Escalation": ("containers.0.securityContext.allowPrivilegeEscalation", True),
    "Running as Non-root": ("containers.0.securityContext.runAsNonRoot", False),
    "Running as Non-root user": ("containers.0.securityContext.runAsUser", 0),
    "Seccomp (baseline)": ("containers.0.securityContext.seccompProfile", {"type": "Unconfined"}),
    "Capabilities": ("containers.0.securityContext.capabilities", {"drop": ["NET_RAW"]}),
}


@pytest.mark.parametrize("control", REFUSED)
def test_the_checker_refuses_what_the_standard_refuses(control):
    path, value = REFUSED[control]
    violations = restricted_violations(_set(_restricted_pod(), path, value))
    assert any(v.split(":")[0] == control for v in violations), violations


def test_the_checker_needs_non_root_and_seccomp_somewhere():
    pod = _restricted_pod()
    del pod["securityContext"]["runAsNonRoot"], pod["securityContext"]["seccompProfile"]
    del pod["containers"][0]["securityContext"]["runAsNonRoot"]
    controls = {v.split(":")[0] for v in restricted_violations(pod)}
    assert controls == {"Running as Non-root", "Seccomp"}
    assert restricted_violations(pod, {"container.apparmor.security.beta.kubernetes.io/x": "unconfined"})[0].startswith(
        "AppArmor"
    )
