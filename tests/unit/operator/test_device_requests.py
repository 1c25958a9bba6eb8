"""How an RLJob's pods ask for devices (builders/ray_cluster.py's docstring): NPU jobs a custom Ray
resource over the device plugin's, GPU jobs Ray's built-in GPU count (`num-gpus`) over a GPU
device plugin's resource, CPU jobs (`resources.device: cpu`) no device plugin's resource at all; and
the spec problems that keep the three apart."""

from __future__ import annotations

import json
import shlex

import kubernetes_validate
import pytest
from rljob_testing import KUBERNETES_VERSION, error_paths, kuberay_raycluster_validator, set_path, spec_dict
from test_reconcile import NAME, body, make_world

from rldock.operator.api import PodDefaults, RLJobSpec
from rldock.operator.builders import RLJobRef, build_ray_cluster, device_resource
from rldock.operator.validation import parse_spec
from rldock_e2e.doubles.kuberay_pods import ray_start_command

JOB = RLJobRef(name="grpo-demo", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")
ASCEND = PodDefaults()  # the installation's default: huawei.com/Ascend910
NVIDIA = PodDefaults(device_resource="nvidia.com/gpu")  # installed with runtime.deviceResource=nvidia.com/gpu
OTHER_GPU = PodDefaults(device_resource="example.com/gpu")


def _spec(resources: dict, **sections) -> RLJobSpec:
    raw = spec_dict(**sections)
    raw["job"]["resources"].update(resources)
    return RLJobSpec.model_validate(raw)


def _groups(cluster: dict) -> tuple[dict, dict]:
    (worker,) = cluster["spec"]["workerGroupSpecs"]
    return cluster["spec"]["headGroupSpec"], worker


def _limits(group: dict) -> dict[str, str]:
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    return container["resources"]["limits"]


GPU = {"accelerator_resource": "GPU", "devices_per_node": 8}
CPU = {"device": "cpu", "devices_per_node": 4}

# case: (job.resources, spec.cluster, operator defaults, worker's device resource or None,
#        worker rayStartParams, head rayStartParams beyond num-cpus and dashboard-host)
CASES = {
    "npu": ({}, {}, ASCEND, "huawei.com/Ascend910", {"resources": shlex.quote('{"NPU": 8}')}, {}),
    "gpu on an ascend installation": (GPU, {}, ASCEND, "nvidia.com/gpu", {"num-gpus": "8"}, {"num-gpus": "0"}),
    "gpu on a gpu installation": (GPU, {}, NVIDIA, "nvidia.com/gpu", {"num-gpus": "8"}, {"num-gpus": "0"}),
    "gpu on another gpu plugin's installation": (
        GPU,
        {},
        OTHER_GPU,
        "example.com/gpu",
        {"num-gpus": "8"},
        {"num-gpus": "0"},
    ),
    "gpu naming its resource": (
        GPU,
        {"deviceResource": "nvidia.com/mig-1g.10gb"},
        ASCEND,
        "nvidia.com/mig-1g.10gb",
        {"num-gpus": "8"},
        {"num-gpus": "0"},
    ),
    "cpu": (CPU, {}, ASCEND, None, {"resources": shlex.quote('{"NPU": 4}')}, {}),
    "cpu on a gpu installation": (CPU, {}, NVIDIA, None, {"resources": shlex.quote('{"NPU": 4}')}, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_pods_and_ray_ask_for_the_jobs_devices(case):
    resources, cluster, defaults, resource, worker_params, head_params = CASES[case]
    spec = _spec(resources, cluster=cluster)
    head, worker = _groups(build_ray_cluster(job=JOB, spec=spec, defaults=defaults))
    devices = str(spec.job.resources.devices_per_node)
    assert _limits(worker) == {"cpu": "32", "memory": "256Gi", **({resource: devices} if resource else {})}
    assert _limits(head) == {"cpu": "8", "memory": "32Gi"}  # the head never asks for a device
    assert worker["rayStartParams"] == worker_params
    assert head["rayStartParams"] == {"num-cpus": "8", "dashboard-host": "0.0.0.0", **head_params}
    assert device_resource(spec, defaults) == resource


@pytest.mark.parametrize("case", CASES)
def test_device_requests_are_valid_pods_and_rayclusters(case):
    resources, cluster, defaults, *_ = CASES[case]
    built = build_ray_cluster(job=JOB, spec=_spec(resources, cluster=cluster), defaults=defaults)
    assert error_paths(kuberay_raycluster_validator(), built) == []
    for group, name in zip(_groups(built), ("head", "worker"), strict=True):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": group["template"]["spec"]}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def test_kuberay_starts_a_gpu_worker_with_rays_gpu_count():
    """The `ray start` line KubeRay makes of the worker group (transcribed in the KubeRay double):
    Ray's --num-gpus from rayStartParams, no custom GPU resource, which Ray would refuse."""
    head, worker = _groups(build_ray_cluster(job=JOB, spec=_spec(GPU)))
    command = ray_start_command(worker["rayStartParams"], head=False, limits=_limits(worker))
    assert "--num-gpus=8" in shlex.split(command) and "--resources" not in command
    head_command = ray_start_command(head["rayStartParams"], head=True, limits=_limits(head))
    assert "--num-gpus=0" in shlex.split(head_command)


def test_kuberay_starts_a_cpu_worker_with_emulated_devices():
    _, worker = _groups(build_ray_cluster(job=JOB, spec=_spec(CPU)))
    words = shlex.split(ray_start_command(worker["rayStartParams"], head=False, limits=_limits(worker)))
    (resources,) = [w for w in words if w.startswith("--resources=")]
    assert json.loads(resources.removeprefix("--resources=")) == {"NPU": 4}
    assert not [w for w in words if w.startswith("--num-gpus")]


def _problems(path: str, value, *more: tuple[str, object]) -> list[tuple[str, str]]:
    raw = set_path(spec_dict(), path, value)
    for other_path, other_value in more:
        raw = set_path(raw, other_path, other_value)
    _, problems = parse_spec(raw)
    return [(p.path, p.message) for p in problems]


@pytest.mark.parametrize(
    "resources",
    [
        {"accelerator_resource": "GPU"},
        {"accelerator_resource": "GPU", "device": "cuda"},
        {"device": "cpu"},
        {"device": "cpu", "accelerator_resource": "NPU"},
    ],
)
def test_gpu_and_cpu_jobs_are_valid(resources):
    raw = spec_dict()
    raw["job"]["resources"].update(resources)
    assert parse_spec(raw)[1] == []


@pytest.mark.parametrize(
    "path, value, more, problem_at, words",
    [
        # Ray's other built-ins stay refused; the message names both names that work.
        ("job.resources.accelerator_resource", "CPU", (), "spec.job.resources.accelerator_resource", "NPU"),
        ("job.resources.accelerator_resource", "TPU", (), "spec.job.resources.accelerator_resource", "GPU"),
        ("job.resources.accelerator_resource", "memory", (), "spec.job.resources.accelerator_resource", "built-in"),
        # GPUs asked of the pods while the job runs on the CPU.
        (
            "job.resources.accelerator_resource",
            "GPU",
            (("job.resources.device", "cpu"),),
            "spec.job.resources.accelerator_resource",
            "resources.device cpu",
        ),
        # A device resource a CPU job would never ask for.
        (
            "cluster.deviceResource",
            "huawei.com/Ascend910",
            (("job.resources.device", "cpu"),),
            "spec.cluster.deviceResource",
            "requests no device",
        ),
        # Ascend NPUs counted by Ray as GPUs.
        (
            "cluster.deviceResource",
            "huawei.com/Ascend910",
            (("job.resources.accelerator_resource", "GPU"),),
            "spec.cluster.deviceResource",
            "nvidia.com/gpu",
        ),
    ],
)
def test_device_problems_name_the_field(path, value, more, problem_at, words):
    problems = _problems(path, value, *more)
    assert [p for p, _ in problems] == [problem_at], problems
    assert words in problems[0][1], problems


@pytest.mark.parametrize(
    "resources, created",
    [
        (GPU, "with 8 nvidia.com/gpu each"),
        (CPU, "with no device (resources.device cpu)"),
    ],
)
def test_the_reconciler_creates_gpu_and_cpu_clusters(resources, created):
    """Through the reconciler, as the operator runs it (its default installation, Ascend): the job
    is accepted, the cluster created with the job's devices, and the event says which."""
    reconciler, kube, _ = make_world()
    raw = body()
    raw["spec"]["job"]["resources"].update(resources)
    outcome = reconciler.reconcile(raw)
    _, worker = _groups(kube.objects[("RayCluster", NAME)])
    assert _limits(worker).keys() == ({"cpu", "memory", "nvidia.com/gpu"} if resources is GPU else {"cpu", "memory"})
    messages = [e.message for e in outcome.events if e.reason.value == "CreatedRayCluster"]
    assert len(messages) == 1 and created in messages[0], [(e.reason, e.message) for e in outcome.events]
