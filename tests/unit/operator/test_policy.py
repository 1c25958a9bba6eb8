"""The admin policy (policy.py): what an RLJob may ask beyond the secure default, table-driven,
and the NetworkPolicy and token every RLJob gets."""

from __future__ import annotations

import kubernetes_validate
import pytest
from rljob_testing import KUBERNETES_VERSION, spec_dict

from rldock.operator import naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders import RLJobRef, build_network_policy
from rldock.operator.policy import AdminPolicy, parse_policy, policy_problems
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
    (NFS, {}, ["spec.volumes[0].nfs.server"]),
    (NFS, {"nfsServers": ["nfs.example.com"]}, []),
    (NFS, {"nfsServers": ["*"]}, []),
    ({"image": "evil.example.com/root:1"}, {}, ["spec.image"]),
    ({"image": DEFAULT_IMAGE}, {}, []),
    ({"image": "registry.example.com/ml/rt:2"}, {"imagePrefixes": ["registry.example.com/ml/"]}, []),
    ({"image": "registry.example.com/mlx/rt:2"}, {"imagePrefixes": ["registry.example.com/ml/"]}, ["spec.image"]),
    ({"scheduling": {"schedulerName": "custom"}}, {}, []),
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
    spec = RLJobSpec.model_validate(spec_dict(**sections))
    problems = policy_problems(spec, AdminPolicy.model_validate(policy), default_image=DEFAULT_IMAGE)
    assert [p.path for p in problems] == refused
    for problem in problems:
        assert "policy." in problem.message and "cluster admin" in problem.message


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
    ],
)
def test_a_bad_policy_names_the_chart_value(text, error):
    with pytest.raises(ValueError, match=None) as raised:
        parse_policy(text)
    assert error in str(raised.value)


def test_an_empty_policy_is_the_secure_default():
    assert parse_policy("") == parse_policy("null") == parse_policy("{}") == AdminPolicy()


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
