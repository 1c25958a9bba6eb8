"""The admin policy (policy.py): what an RLJob may ask beyond the secure default, table-driven (every
rule, then image prefixes, NFS exports, control-plane nodes, schedulers and queues each in a table
of their own), a malformed policy refused at start, and the NetworkPolicy and token every RLJob
gets."""

from __future__ import annotations

from decimal import Decimal

import kubernetes_validate
import pytest
from pydantic import ValidationError
from rljob_testing import KUBERNETES_VERSION, spec_dict

from rldock.operator import naming
from rldock.operator.api import RLJobSpec, quantity_amount
from rldock.operator.builders import RLJobRef, build_network_policy
from rldock.operator.policy import (
    CONTROL_PLANE_KEYS,
    PROTECTED_TAINTS,
    AdminPolicy,
    image_allowed,
    parse_policy,
    policy_problems,
)
from rldock.operator.tokens import job_token

DEFAULT_IMAGE = "ghcr.io/rldock/rldock-runtime:0.1.0"
HOST_ROOT = {
    "volumes": [{"name": "root", "hostPath": {"path": "/"}}],
    "volumeMounts": [{"name": "root", "mountPath": "/host"}],
}
SHARED = {
    "volumes": [{"name": "shared", "hostPath": {"path": "/mnt/shared/models"}}],
    "volumeMounts": [{"name": "shared", "mountPath": "/models"}],
}
NFS = {
    "volumes": [{"name": "data", "nfs": {"server": "nfs.example.com", "path": "/data"}}],
    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
}
EVERY_TAINT = {"cluster": {"tolerations": [{"operator": "Exists"}]}}
ONE_TAINT = {
    "cluster": {"tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]}
}


def problems_of(sections: dict, policy: dict) -> list:
    """The policy's problems with a spec_dict(**sections) under the chart values `policy`."""
    spec = RLJobSpec.model_validate(spec_dict(**sections))
    return policy_problems(spec, AdminPolicy.model_validate(policy), default_image=DEFAULT_IMAGE)


CASES = [
    # (spec sections, policy, the fields refused)
    ({}, {}, []),
    (HOST_ROOT, {}, ["spec.volumes[0].hostPath.path"]),
    (HOST_ROOT, {"hostPathPrefixes": ["/mnt/shared"]}, ["spec.volumes[0].hostPath.path"]),
    (HOST_ROOT, {"hostPathPrefixes": ["/"]}, []),
    (SHARED, {"hostPathPrefixes": ["/mnt/shared"]}, []),
    (SHARED, {"hostPathPrefixes": ["/mnt/share"]}, ["spec.volumes[0].hostPath.path"]),  # a prefix of a name
    ({"checkpoint": {"hostPath": "/mnt/rl"}}, {}, ["spec.checkpoint.hostPath"]),
    ({"checkpoint": {"hostPath": "/mnt/rl/x/../y"}}, {"hostPathPrefixes": ["/mnt/rl"]}, []),
    ({"checkpoint": {"hostPath": "/mnt/rl/../etc"}}, {"hostPathPrefixes": ["/mnt/rl"]}, ["spec.checkpoint.hostPath"]),
    (NFS, {}, ["spec.volumes[0].nfs"]),
    (NFS, {"nfsExports": [{"server": "nfs.example.com", "path": "/data"}]}, []),
    (NFS, {"nfsExports": [{"server": "nfs.example.com", "path": "/"}]}, []),
    (NFS, {"nfsExports": [{"server": "other.example.com", "path": "/"}]}, ["spec.volumes[0].nfs"]),
    ({"image": "evil.example.com/root:1"}, {}, ["spec.image"]),
    ({"image": DEFAULT_IMAGE}, {}, []),
    ({"image": "registry.example.com/ml/rt:2"}, {"imagePrefixes": ["registry.example.com/ml/"]}, []),
    ({"image": "registry.example.com/mlx/rt:2"}, {"imagePrefixes": ["registry.example.com/ml/"]}, ["spec.image"]),
    ({"image": "registry.example.com/ml-evil/x"}, {"imagePrefixes": ["registry.example.com/ml"]}, ["spec.image"]),
    # The environments' images (spec.environments): the same rule; unset is the runtime image.
    ({"environments": [{"name": "e"}]}, {}, []),
    ({"environments": [{"name": "e", "image": DEFAULT_IMAGE}]}, {}, []),
    ({"environments": [{"name": "e", "image": "evil.example.com/env:1"}]}, {}, ["spec.environments[0].image"]),
    (
        {"environments": [{"name": "a", "image": "registry.example.com/envs/a:1"}, {"name": "b", "image": "b:1"}]},
        {"imagePrefixes": ["registry.example.com/envs/"]},
        ["spec.environments[1].image"],
    ),
    (
        {
            "image": "registry.example.com/ml/rt:2",
            "environments": [{"name": "e", "image": "registry.example.com/ml-x"}],
        },
        {"imagePrefixes": ["registry.example.com/ml"]},
        ["spec.environments[0].image"],
    ),
    ({"scheduling": {"schedulerName": "custom"}}, {}, ["spec.scheduling.schedulerName"]),
    ({"scheduling": {"schedulerName": "custom"}}, {"schedulerNames": None}, []),
    ({"scheduling": {"schedulerName": "custom"}}, {"schedulerNames": ["volcano"]}, ["spec.scheduling.schedulerName"]),
    ({"scheduling": {"gang": "kueue", "queue": "other-team"}}, {"queues": ["team-a"]}, ["spec.scheduling.queue"]),
    (EVERY_TAINT, {}, ["spec.cluster.tolerations[0]"]),
    (EVERY_TAINT, {"tolerations": [{"operator": "Exists"}]}, []),
    (ONE_TAINT, {}, []),
    (
        ONE_TAINT,
        {"tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists"}]},
        ["spec.cluster.tolerations[0]"],
    ),
    (ONE_TAINT, {"tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}]}, []),
    (
        {"cluster": {"nodeSelector": {"pool": "a"}}},
        {"nodeSelectors": {"pool": ["b"]}},
        ["spec.cluster.nodeSelector[pool]"],
    ),
    ({"cluster": {"nodeSelector": {"pool": "b"}}}, {"nodeSelectors": {"pool": ["b"]}}, []),
]


@pytest.mark.parametrize("sections, policy, refused", CASES)
def test_policy(sections, policy, refused):
    problems = problems_of(sections, policy)
    assert [p.path for p in problems] == refused
    for problem in problems:
        assert "policy." in problem.message and "cluster admin" in problem.message


IMAGE_CASES = [
    # (image, prefix, admitted)
    ("registry.example.com/ml/rt:1", "registry.example.com/ml", True),
    ("registry.example.com/ml:1", "registry.example.com/ml", True),
    ("registry.example.com/ml@sha256:" + "a" * 64, "registry.example.com/ml", True),
    ("registry.example.com/ml", "registry.example.com/ml", True),
    ("registry.example.com/ml-evil/x", "registry.example.com/ml", False),
    ("registry.example.com/mlx", "registry.example.com/ml", False),
    ("registry.example.com.evil.io/x", "registry.example.com", False),
    ("registry.example.com/x", "registry.example.com", True),
    ("registry.example.com:5000/x", "registry.example.com", True),  # the host's other port: `:` is a boundary
    ("registry.example.com:5000/x", "registry.example.com/", False),  # ... unless the prefix says `/`
    ("registry.example.com/ml/rt:1", "registry.example.com/ml/", True),
    ("registry.example.com/ml", "registry.example.com/ml/", False),
    ("registry.example.com/ml/rt:1", "registry.example.com/ml/rt:", True),
    ("registry.example.com/ml/rt:1-evil", "registry.example.com/ml/rt:1", False),
    ("registry.example.com/ml/rt@sha256:" + "b" * 64, "registry.example.com/ml/rt@", True),
    ("registry.example.com/ml/rt:1@sha256:" + "b" * 64, "registry.example.com/ml/rt:1", True),
]


@pytest.mark.parametrize("image, prefix, admitted", IMAGE_CASES)
def test_image_prefixes_match_at_a_boundary(image, prefix, admitted):
    assert image_allowed(image, [prefix]) is admitted
    problems = problems_of({"image": image}, {"imagePrefixes": [prefix]})
    assert [p.path for p in problems] == ([] if admitted else ["spec.image"])


def nfs(server: str, path: str) -> dict:
    return {
        "volumes": [{"name": "data", "nfs": {"server": server, "path": path}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }


TEAM_A = [{"server": "nfs.example.com", "path": "/exports/team-a"}]
NFS_REFUSED = "spec.volumes[0].nfs"
NFS_CASES = [
    # (server, path, exports, the field refused)
    ("nfs.example.com", "/exports/team-a", TEAM_A, None),
    ("nfs.example.com", "/exports/team-a/", TEAM_A, None),  # trailing slashes are normalised
    ("nfs.example.com", "/exports/team-a/models", TEAM_A, None),
    ("nfs.example.com", "//exports//team-a/./models", TEAM_A, None),
    ("NFS.example.com", "/exports/team-a", TEAM_A, None),  # host names compare without case
    ("nfs.example.com", "/exports/team-ab", TEAM_A, NFS_REFUSED),  # a prefix of a name is not a directory above it
    ("nfs.example.com", "/exports", TEAM_A, NFS_REFUSED),
    ("nfs.example.com", "/", TEAM_A, NFS_REFUSED),  # the server's root needs `/` listed
    ("nfs.example.com", "/exports/team-a/../team-b", TEAM_A, "spec.volumes[0].nfs.path"),  # `..` is refused outright
    ("nfs.example.com", "/exports/team-a/..", TEAM_A, "spec.volumes[0].nfs.path"),
    ("nfs.example.com.evil.io", "/exports/team-a", TEAM_A, NFS_REFUSED),
    ("10.0.0.5", "/exports/team-a", TEAM_A, NFS_REFUSED),  # an address is not the name the admin listed
    ("nfs.example.com", "/", [{"server": "nfs.example.com", "path": "/"}], None),
    ("nfs.example.com", "/anything", [{"server": "nfs.example.com", "path": "/"}], None),
    ("nfs.example.com", "/exports/team-a", [{"server": "nfs.example.com", "path": "/exports/team-a/"}], None),
    ("nfs.example.com", "/exports/team-a", [], NFS_REFUSED),
]


@pytest.mark.parametrize("server, path, exports, refused", NFS_CASES)
def test_nfs_volumes_need_a_listed_export(server, path, exports, refused):
    problems = problems_of(nfs(server, path), {"nfsExports": exports})
    assert [p.path for p in problems] == ([refused] if refused else [])
    for problem in problems:
        assert "policy.nfsExports" in problem.message and repr(path)[1:-1] in problem.message


def tolerate(**toleration: str) -> dict:
    return {"cluster": {"tolerations": [toleration]}}


CONTROL_PLANE_CASES = [
    # (spec sections, policy, the fields refused, what the message names)
    (tolerate(key="node-role.kubernetes.io/control-plane", operator="Exists"), {}, ["spec.cluster.tolerations[0]"]),
    (
        tolerate(key="node-role.kubernetes.io/master", operator="Exists", effect="NoSchedule"),
        {},
        ["spec.cluster.tolerations[0]"],
    ),
    (tolerate(key="node-role.kubernetes.io/control-plane", value=""), {}, ["spec.cluster.tolerations[0]"]),
    (tolerate(operator="Exists"), {}, ["spec.cluster.tolerations[0]"]),  # tolerates every taint
    (tolerate(operator="Exists", effect="NoSchedule"), {}, ["spec.cluster.tolerations[0]"]),
    (
        tolerate(key="node-role.kubernetes.io/control-plane", operator="Exists"),
        {"tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}]},
        [],
    ),  # the admin listed it
    (
        {"cluster": {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}},
        {},
        ["spec.cluster.nodeSelector[node-role.kubernetes.io/control-plane]"],
    ),
    (
        {"cluster": {"nodeSelector": {"node-role.kubernetes.io/master": "true"}}},
        {},
        ["spec.cluster.nodeSelector[node-role.kubernetes.io/master]"],
    ),
    (
        {"cluster": {"nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}},
        {"nodeSelectors": {"node-role.kubernetes.io/control-plane": [""]}},
        [],
    ),
    ({"cluster": {"nodeSelector": {"pool": "ascend"}}}, {}, []),
]


@pytest.mark.parametrize("sections, policy, refused", CONTROL_PLANE_CASES)
def test_control_plane_nodes_are_refused_unless_listed(sections, policy, refused):
    problems = problems_of(sections, policy)
    assert [p.path for p in problems] == refused
    for problem in problems:
        rule = "policy.nodeSelectors" if "nodeSelector" in problem.path else "policy.tolerations"
        assert rule in problem.message and "cluster admin" in problem.message, problem.message


LIFECYCLE_TAINTS = [
    "node.kubernetes.io/unschedulable",
    "node.kubernetes.io/not-ready",
    "node.kubernetes.io/unreachable",
    "node.kubernetes.io/memory-pressure",
    "node.kubernetes.io/disk-pressure",
    "node.kubernetes.io/pid-pressure",
    "node.kubernetes.io/network-unavailable",
    "node.kubernetes.io/out-of-service",
]
NOT_READY_FOR_10_MIN = {
    "key": "node.kubernetes.io/not-ready",
    "operator": "Exists",
    "effect": "NoExecute",
    "tolerationSeconds": 600,
}
TOLERATION_0 = ["spec.cluster.tolerations[0]"]
PROTECTED_TAINT_CASES = [
    # (spec sections, policy, the fields refused, the chart values the message names)
    *[
        (tolerate(key=key, operator="Exists"), {}, TOLERATION_0, ["policy.protectedTaints", key])
        for key in LIFECYCLE_TAINTS
    ],
    (tolerate(key="node.kubernetes.io/unschedulable", value=""), {}, TOLERATION_0, ["policy.protectedTaints"]),
    ({"cluster": {"tolerations": [NOT_READY_FOR_10_MIN]}}, {}, TOLERATION_0, ["policy.protectedTaints"]),
    # Each toleration on its own: the second one (index 1) is named.
    (
        {"cluster": {"tolerations": [ONE_TAINT["cluster"]["tolerations"][0], NOT_READY_FOR_10_MIN]}},
        {},
        ["spec.cluster.tolerations[1]"],
        ["policy.protectedTaints", "node.kubernetes.io/not-ready"],
    ),
    # Every taint, the lifecycle's among them: refused whatever protectedTaints says.
    (tolerate(operator="Exists"), {"protectedTaints": []}, TOLERATION_0, ["policy.tolerations"]),
    # The admin takes a key out of protectedTaints: that key is allowed, the others still are not.
    ({"cluster": {"tolerations": [NOT_READY_FOR_10_MIN]}}, {"protectedTaints": []}, [], []),
    (
        tolerate(key="node.kubernetes.io/unreachable", operator="Exists"),
        {"protectedTaints": ["node.kubernetes.io/unreachable"]},
        TOLERATION_0,
        ["policy.protectedTaints"],
    ),
    (
        tolerate(key="node.kubernetes.io/not-ready", operator="Exists"),
        {"protectedTaints": ["node.kubernetes.io/unreachable"]},
        [],
        [],
    ),
    # An admin's own protected key, named in the message.
    (
        tolerate(key="example.com/reserved", operator="Exists"),
        {"protectedTaints": ["example.com/reserved"]},
        TOLERATION_0,
        ["nodes tainted example.com/reserved"],
    ),
    # ... or the admin lists the toleration itself (tolerations as a list: only what is listed).
    (
        {"cluster": {"tolerations": [NOT_READY_FOR_10_MIN]}},
        {"tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}]},
        [],
        [],
    ),
    (
        tolerate(key="node.kubernetes.io/unschedulable", operator="Exists"),
        {"tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists"}]},
        TOLERATION_0,
        ["policy.tolerations"],
    ),
]


@pytest.mark.parametrize("sections, policy, refused, named", PROTECTED_TAINT_CASES)
def test_node_lifecycle_taints_are_refused_unless_allowed(sections, policy, refused, named):
    problems = problems_of(sections, policy)
    assert [p.path for p in problems] == refused
    for problem in problems:
        assert "cluster admin" in problem.message, problem.message
        for words in named:
            assert words in problem.message, problem.message


def test_a_protected_taint_s_refusal_says_which_nodes_and_both_ways_to_allow_it():
    (problem,) = problems_of(tolerate(key="node.kubernetes.io/unschedulable", operator="Exists"), {})
    assert str(problem) == (
        'spec.cluster.tolerations[0]: toleration {"key": "node.kubernetes.io/unschedulable", "operator": "Exists"} '
        "lets the pods onto cordoned nodes (an admin is draining them), which the cluster's policy does not allow "
        "(policy.protectedTaints lists node.kubernetes.io/unschedulable); remove it, or ask the cluster admin to "
        "take node.kubernetes.io/unschedulable out of policy.protectedTaints or to list this toleration in "
        "policy.tolerations"
    )


def test_the_default_protected_taints_are_the_control_plane_s_and_the_node_lifecycle_s():
    assert AdminPolicy().protected_taints == list(PROTECTED_TAINTS)
    assert set(PROTECTED_TAINTS) == {*CONTROL_PLANE_KEYS, *LIFECYCLE_TAINTS}


SCHEDULING_CASES = [
    # (spec.scheduling, policy, the fields refused)
    ({}, {}, []),  # the cluster's default scheduler
    ({"schedulerName": "default-scheduler"}, {}, []),
    ({"schedulerName": "my-scheduler"}, {}, ["spec.scheduling.schedulerName"]),
    ({"schedulerName": "my-scheduler"}, {"schedulerNames": ["my-scheduler"]}, []),
    ({"gang": "volcano"}, {}, ["spec.scheduling.gang"]),  # Volcano's scheduler
    ({"gang": "volcano"}, {"schedulerNames": ["volcano"]}, []),
    ({"gang": "volcano", "queue": "research"}, {"schedulerNames": ["volcano"]}, ["spec.scheduling.queue"]),
    ({"gang": "volcano", "queue": "research"}, {"schedulerNames": ["volcano"], "queues": ["research"]}, []),
    ({"gang": "kueue", "queue": "team-a"}, {}, ["spec.scheduling.queue"]),  # no queue label unless listed
    ({"gang": "kueue", "queue": "team-a"}, {"queues": ["team-a"]}, []),
    ({"gang": "kueue", "queue": "team-a"}, {"queues": None}, []),
]


@pytest.mark.parametrize("scheduling, policy, refused", SCHEDULING_CASES)
def test_only_listed_schedulers_and_queues(scheduling, policy, refused):
    problems = problems_of({"scheduling": scheduling}, policy)
    assert [p.path for p in problems] == refused
    for problem in problems:
        assert ("policy.schedulerNames" in problem.message) != ("policy.queues" in problem.message), problem.message


def test_the_message_names_the_value_and_the_policy():
    spec = RLJobSpec.model_validate(spec_dict(**HOST_ROOT))
    (problem,) = policy_problems(spec, AdminPolicy(host_path_prefixes=["/mnt/shared"]), default_image=DEFAULT_IMAGE)
    assert str(problem) == (
        "spec.volumes[0].hostPath.path: hostPath '/' is not allowed by the cluster's policy "
        '(policy.hostPathPrefixes: ["/mnt/shared"]); use an allowed value or ask the cluster '
        "admin to allow it"
    )


@pytest.mark.parametrize(
    "text, error",
    [
        ('{"hostPathPrefixes": ["relative"]}', "policy.hostPathPrefixes[0]: 'relative' must be an absolute path"),
        ('{"hostPath": []}', "policy.hostPath"),
        ('{"tolerations": [{"operator": "Exists", "colour": "red"}]}', "policy.tolerations.0.colour"),
        ("{", "policy: not JSON"),
        ('{"imagePrefixes": [""]}', "policy.imagePrefixes[0]: '' is empty"),
        (
            '{"imagePrefixes": ["registry.example.com/ml", " r.io"]}',
            "policy.imagePrefixes[1]: ' r.io' contains whitespace",
        ),
        (
            '{"imagePrefixes": ["https://registry.example.com"]}',
            "policy.imagePrefixes[0]: 'https://registry.example.com' has a scheme",
        ),
        ('{"imagePrefixes": ["*"]}', "policy.imagePrefixes[0]: '*' is not the start of an image reference"),
        ('{"imagePrefixes": ["/ml"]}', "policy.imagePrefixes[0]: '/ml' is not the start of an image reference"),
        ('{"imagePrefixes": ["r.io//ml"]}', "policy.imagePrefixes[0]: 'r.io//ml' is not the start"),
        ('{"protectedTaints": [""]}', "policy.protectedTaints[0]: '' is not a taint key"),
        ('{"nfsExports": [{"server": "nfs.example.com"}]}', "policy.nfsExports.0.path"),
        ('{"nfsExports": [{"server": "*", "path": "/"}]}', "policy.nfsExports[0].server: '*' is not a host name"),
        (
            '{"nfsExports": [{"server": "nfs", "path": "exports"}]}',
            "policy.nfsExports[0].path: 'exports' must be an absolute",
        ),
        (
            '{"nfsExports": [{"server": "nfs", "path": "/a/../b"}]}',
            "policy.nfsExports[0].path: '/a/../b' must not contain '..'",
        ),
        # The old list of bare servers is refused with its migration, not read as "any path".
        ('{"nfsServers": ["nfs.example.com"]}', "[{server: nfs.example.com, path: /<export>}]"),
        ('{"environments": {"egress": [{"to": [{}]}]}}', "policy.environments.egress[0].to[0]: names no ipBlock"),
        (
            '{"environments": {"egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]}]}}',
            "policy.environments.egress[0].to[0].ipBlock: '10.0.0.0/33' is not a CIDR",
        ),
        ('{"environments": {"maxReplicas": 0}}', "policy.environments.maxReplicas"),
        ('{"environments": {"maxCpu": "lots"}}', "policy.environments.maxCpu"),
    ],
)
def test_a_bad_policy_names_the_chart_value(text, error):
    with pytest.raises(ValueError, match=None) as raised:
        parse_policy(text)
    assert error in str(raised.value)


def test_an_empty_policy_is_the_secure_default():
    assert parse_policy("") == parse_policy("null") == parse_policy("{}") == AdminPolicy()
    default = AdminPolicy()
    assert default.scheduler_names == ["default-scheduler"] and default.queues == []
    assert default.nfs_exports == [] and default.image_prefixes == [] and default.host_path_prefixes == []
    assert parse_policy('{"nfsServers": []}') == default  # an upgraded values file keeps working


def test_good_prefixes_and_exports_load():
    policy = parse_policy(
        '{"imagePrefixes": ["registry.example.com", "registry.example.com:5000/ml/", "r.io/ml/rt:", "r.io/x@"],'
        ' "nfsExports": [{"server": "10.0.0.5", "path": "/"}, {"server": "fd00::5", "path": "/exports/a/"}]}'
    )
    assert len(policy.image_prefixes) == 4 and len(policy.nfs_exports) == 2


JOB = RLJobRef(name="grpo", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")


def test_the_network_policy_admits_the_jobs_pods_and_the_operator_on_the_jobs_api():
    policy = build_network_policy(
        job=JOB, operator_namespace="rldock-system", operator_pod_labels={"app.kubernetes.io/name": "rldock"}
    )
    kubernetes_validate.validate(policy, KUBERNETES_VERSION, strict=True)
    assert policy["metadata"]["name"] == naming.network_policy_name(JOB.name)
    assert policy["spec"]["podSelector"] == {"matchLabels": {"rldock.io/rljob": "grpo"}}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress (models, rewards) stays open
    own, operator = policy["spec"]["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"rldock.io/rljob": "grpo"}}}]}
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert operator["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rldock-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rldock"}},
        }
    ]
    alone = build_network_policy(job=JOB, operator_namespace=None, operator_pod_labels={})
    assert len(alone["spec"]["ingress"]) == 1  # an operator outside the cluster gets no rule


def test_tokens_are_derived_per_rljob_object():
    key = b"k" * 32
    token = job_token(key, JOB)
    assert len(token) == 64 and token == job_token(key, JOB)
    assert token != job_token(key, RLJobRef(JOB.name, JOB.namespace, "another-uid"))  # re-created: new token
    assert token != job_token(b"x" * 32, JOB)
    with pytest.raises(ValueError):
        job_token(b"", JOB)


# --- spec.environments: each entry's pods within the admin's bounds ------------------------------

BOUNDS = AdminPolicy.model_validate(
    {
        "environments": {
            "maxReplicas": 4,
            "maxCpu": "2",
            "maxMemory": "4Gi",
            "maxEphemeralStorage": "2Gi",
            "maxPods": 1024,  # the total has its own test
        }
    }
)


@pytest.mark.parametrize(
    "entry, refused",
    [
        ({}, []),  # the defaults: 1 replica, cpu 1, memory 1Gi, 1Gi of disk
        ({"replicas": 4, "resources": {"cpu": "2000m", "memory": "4096Mi"}, "ephemeralStorage": "2Gi"}, []),
        ({"replicas": 5}, ["spec.environments[0].replicas"]),
        ({"resources": {"cpu": "2001m", "memory": "1Gi"}}, ["spec.environments[0].resources.cpu"]),
        ({"resources": {"cpu": 3, "memory": "1Gi"}}, ["spec.environments[0].resources.cpu"]),
        ({"resources": {"cpu": 1, "memory": "5G"}}, ["spec.environments[0].resources.memory"]),
        ({"ephemeralStorage": "3e9"}, ["spec.environments[0].ephemeralStorage"]),
        (
            {"replicas": 256, "resources": {"cpu": 64, "memory": "1Ti"}, "ephemeralStorage": "1Ti"},
            [
                "spec.environments[0].replicas",
                "spec.environments[0].resources.cpu",
                "spec.environments[0].resources.memory",
                "spec.environments[0].ephemeralStorage",
            ],
        ),
    ],
    ids=["defaults", "at-the-bounds", "replicas", "cpu-milli", "cpu", "memory-decimal", "disk-exponent", "all"],
)
def test_environment_pods_stay_within_the_admin_s_bounds(entry, refused):
    spec = RLJobSpec.model_validate(spec_dict(environments=[{"name": "env", **entry}]))
    problems = policy_problems(spec, BOUNDS, default_image=DEFAULT_IMAGE)
    assert [problem.path for problem in problems] == refused
    for problem in problems:
        assert "policy.environments.max" in problem.message and "ask for at most" in problem.message


def test_the_default_bounds_refuse_the_issue_s_256_replicas():
    spec = RLJobSpec.model_validate(spec_dict(environments=[{"name": "env", "replicas": 256}]))
    problem, total = policy_problems(spec, AdminPolicy(), default_image=DEFAULT_IMAGE)
    assert problem.path == "spec.environments[0].replicas"
    assert problem.message == (
        "replicas 256 is more than the cluster's policy allows (policy.environments.maxReplicas: 16); "
        "ask for at most 16 or ask the cluster admin to raise it"
    )
    assert total.path == "spec.environments" and "policy.environments.maxPods: 32" in total.message


@pytest.mark.parametrize(
    "replicas, refused",
    [
        ([16, 16], False),  # at the default bound (32)
        ([16, 16, 1], True),
        ([16] * 16, True),  # the reviewer's 256 pods, each entry within maxReplicas
        ([1] * 16, False),
    ],
)
def test_the_environments_pods_in_all_stay_within_the_admin_s_bound(replicas, refused):
    entries = [{"name": f"env{index}", "replicas": count} for index, count in enumerate(replicas)]
    spec = RLJobSpec.model_validate(spec_dict(environments=entries))
    problems = policy_problems(spec, AdminPolicy(), default_image=DEFAULT_IMAGE)
    assert [problem.path for problem in problems] == (["spec.environments"] if refused else [])
    for problem in problems:
        assert f"add up to {sum(replicas)} pods" in problem.message
        assert "policy.environments.maxPods: 32" in problem.message and "ask for at most 32" in problem.message


def test_the_admin_sets_the_environments_total():
    spec = RLJobSpec.model_validate(spec_dict(environments=[{"name": "a", "replicas": 2}, {"name": "b"}]))
    policy = AdminPolicy.model_validate({"environments": {"maxPods": 2}})
    (problem,) = policy_problems(spec, policy, default_image=DEFAULT_IMAGE)
    assert problem.path == "spec.environments" and "maxPods: 2" in problem.message


@pytest.mark.parametrize(
    "quantity, amount",
    [
        (4, "4"),
        ("500m", "0.5"),
        ("0.5", "0.5"),
        ("1Gi", str(1024**3)),
        ("1G", str(10**9)),
        ("1e3", "1000"),
        ("1.5Ki", "1536"),
        ("100u", "0.0001"),
        ("1Ei", str(1024**6)),  # the suffixes that start like an exponent
        ("1E", str(10**18)),
        ("2e+2", "200"),
    ],
)
def test_quantities_compare_by_the_amount_they_stand_for(quantity, amount):
    assert quantity_amount(quantity) == Decimal(amount)


@pytest.mark.parametrize(
    "quantity, message",
    [("lots", "is not a quantity"), ("1e99999999999", "too large an amount"), ("1e", "is not a quantity")],
)
def test_a_quantity_that_is_none_is_refused(quantity, message):
    with pytest.raises(ValueError, match=message):
        quantity_amount(quantity)


def test_an_out_of_range_quantity_is_refused_naming_its_field():
    spec = spec_dict(environments=[{"name": "env", "resources": {"cpu": 1, "memory": "1e99999999999"}}])
    with pytest.raises(ValidationError) as caught:
        RLJobSpec.model_validate(spec)
    (error,) = caught.value.errors()
    assert error["loc"] == ("environments", 0, "resources", "memory")
    assert "too large an amount" in error["msg"]
