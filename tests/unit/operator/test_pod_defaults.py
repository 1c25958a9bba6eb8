"""The installation's pod defaults (image, pull policy, device resource): where an RLJob leaves them
unset the operator's settings fill them in, an RLJob that sets them wins, and the settings reach
the RayCluster through the reconciler (the builders never read the environment)."""

from __future__ import annotations

import pytest
from rljob_testing import spec_dict
from test_reconcile import NAME, FakeJobs, FakeKube, body

from rldock.operator.api import PodDefaults, RLJobSpec
from rldock.operator.builders import RLJobRef, build_ray_cluster
from rldock.operator.constants import (
    ANNOTATION_SPEC_HASH,
    DEFAULT_DEVICE_RESOURCE,
    DEFAULT_IMAGE,
    EventReason,
    ImagePullPolicy,
)
from rldock.operator.reconcile import Reconciler
from rldock.operator.settings import DashboardAddress, OperatorSettings, load_settings
from rldock.operator.validation import parse_spec

KEY = {"RLDOCK_TOKEN_KEY": "k" * 32}

JOB = RLJobRef(name="grpo-demo", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")
CUDA = PodDefaults(
    image="registry.example.com/rl/runtime:0.1.0-cuda",
    image_pull_policy=ImagePullPolicy.ALWAYS,
    device_resource="nvidia.com/gpu",
)


def _containers(cluster: dict) -> dict[str, dict]:
    """Container name -> container, of the head and the worker group."""
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    (workers,) = cluster["spec"]["workerGroupSpecs"]
    return {c["name"]: c for c in head + workers["template"]["spec"]["containers"]}


def _spec(**sections) -> RLJobSpec:
    spec, problems = parse_spec(spec_dict(**sections))
    assert problems == [] and spec is not None
    return spec


def test_the_built_in_defaults_are_the_constants():
    assert PodDefaults() == PodDefaults(
        image=DEFAULT_IMAGE, image_pull_policy=ImagePullPolicy.IF_NOT_PRESENT, device_resource=DEFAULT_DEVICE_RESOURCE
    )
    spec = _spec()
    assert spec.image is None and spec.cluster.device_resource is None  # left to the installation
    containers = _containers(build_ray_cluster(job=JOB, spec=spec))
    assert {c["image"] for c in containers.values()} == {DEFAULT_IMAGE}
    assert {c["imagePullPolicy"] for c in containers.values()} == {"IfNotPresent"}
    assert containers["ray-worker"]["resources"]["limits"][DEFAULT_DEVICE_RESOURCE] == "8"


def test_an_unset_spec_takes_the_installation_defaults():
    containers = _containers(build_ray_cluster(job=JOB, spec=_spec(), defaults=CUDA))
    assert {c["image"] for c in containers.values()} == {"registry.example.com/rl/runtime:0.1.0-cuda"}
    assert {c["imagePullPolicy"] for c in containers.values()} == {"Always"}
    worker = containers["ray-worker"]["resources"]
    assert worker["requests"]["nvidia.com/gpu"] == worker["limits"]["nvidia.com/gpu"] == "8"
    assert DEFAULT_DEVICE_RESOURCE not in worker["limits"]
    assert not [r for r in containers["ray-head"]["resources"]["limits"] if "/" in r]  # no devices on the head


def test_what_the_spec_sets_wins_over_the_defaults():
    spec = _spec(image="registry.local/rldock:dev", cluster={"deviceResource": "example.org/npu"})
    containers = _containers(build_ray_cluster(job=JOB, spec=spec, defaults=CUDA))
    assert {c["image"] for c in containers.values()} == {"registry.local/rldock:dev"}
    assert {c["imagePullPolicy"] for c in containers.values()} == {"Always"}  # operator-wide only
    assert containers["ray-worker"]["resources"]["limits"]["example.org/npu"] == "8"
    assert "nvidia.com/gpu" not in containers["ray-worker"]["resources"]["limits"]


def test_changing_a_default_changes_the_spec_hash():
    """A new default image (e.g. after `helm upgrade`) replaces the cluster between attempts (actions.py)."""

    def spec_hash(defaults: PodDefaults, **sections) -> str:
        return build_ray_cluster(job=JOB, spec=_spec(**sections), defaults=defaults)["metadata"]["annotations"][
            ANNOTATION_SPEC_HASH
        ]

    assert spec_hash(PodDefaults()) != spec_hash(PodDefaults(image="registry.local/rldock:0.2.0"))
    assert spec_hash(PodDefaults()) != spec_hash(PodDefaults(image_pull_policy=ImagePullPolicy.NEVER))
    # An RLJob that names its image is not affected by the default image.
    pinned = {"image": "registry.local/rldock:dev"}
    assert spec_hash(PodDefaults(), **pinned) == spec_hash(PodDefaults(image="registry.local/rldock:0.2.0"), **pinned)


def test_an_unset_device_resource_is_not_a_spec_problem_but_a_bad_set_one_is():
    assert parse_spec(spec_dict())[1] == []
    _, problems = parse_spec(spec_dict(cluster={"deviceResource": "Ascend910"}))
    assert [p.path for p in problems] == ["spec.cluster.deviceResource"]


# --- settings ---------------------------------------------------------------------------------


def test_settings_read_the_defaults_from_the_environment_and_flags():
    assert load_settings([], KEY).pod_defaults == PodDefaults()
    env = {
        **KEY,
        "RLDOCK_DEFAULT_IMAGE": CUDA.image,
        "RLDOCK_IMAGE_PULL_POLICY": "Always",
        "RLDOCK_DEFAULT_DEVICE_RESOURCE": "nvidia.com/gpu",
    }
    assert load_settings([], env).pod_defaults == CUDA
    flagged = load_settings(
        [
            "--default-image",
            "r.example.com/x:1",
            "--image-pull-policy",
            "Never",
            "--default-device-resource",
            "example.org/npu",
        ],
        env,
    ).pod_defaults
    assert flagged == PodDefaults(
        image="r.example.com/x:1", image_pull_policy=ImagePullPolicy.NEVER, device_resource="example.org/npu"
    )
    # Empty variables (a chart value rendered empty) count as unset.
    empty = {**{name: "" for name in env}, **KEY}
    assert load_settings([], empty).pod_defaults == PodDefaults()


@pytest.mark.parametrize(
    "argv, env, message",
    [
        ([], {"RLDOCK_DEFAULT_DEVICE_RESOURCE": "Ascend910"}, "default device resource: 'Ascend910' is not"),
        (["--default-device-resource", "kubernetes.io/npu"], {}, "reserved by Kubernetes"),
        ([], {"RLDOCK_IMAGE_PULL_POLICY": "Sometimes"}, "'Sometimes' is not a valid ImagePullPolicy"),
        (["--image-pull-policy", "sometimes"], {}, "invalid choice: 'sometimes'"),
        (["--default-image", "my image:1"], {}, "default image must be an image reference without spaces"),
    ],
)
def test_bad_defaults_are_refused_at_start(argv, env, message, capsys):
    with pytest.raises(SystemExit):
        load_settings(argv, {**KEY, **env})
    assert message in capsys.readouterr().err


# --- the reconciler passes the settings' defaults in -----------------------------------------


def test_the_reconciler_builds_the_cluster_with_the_settings_defaults():
    kube = FakeKube()
    settings = OperatorSettings(dashboard_address=DashboardAddress.POD_IP, pod_defaults=CUDA, token_key=b"k" * 32)
    outcome = Reconciler(kube, settings, jobs_client=FakeJobs().client).reconcile(body())
    containers = _containers(kube.objects[("RayCluster", NAME)])
    assert {c["image"] for c in containers.values()} == {CUDA.image}
    assert containers["ray-worker"]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    (created,) = [e for e in outcome.events if e.reason is EventReason.CREATED_RAY_CLUSTER]
    assert "8 nvidia.com/gpu each" in created.message
