"""Spec problems beyond the schema: the runtime's job rules under `spec.job.`, plus the cluster's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from rljob_testing import DELETE, set_path, spec_dict

from rldock.operator.api import RLJobSpec
from rldock.operator.constants import CONFIG_MAP_MAX_BYTES
from rldock.operator.validation import find_spec_problems, job_config_size_problems, parse_spec


def _paths(raw: dict) -> list[str]:
    spec, problems = parse_spec(raw)
    return [p.path for p in problems]


def test_a_valid_spec_has_no_problems():
    assert _paths(spec_dict()) == []
    assert find_spec_problems(RLJobSpec.model_validate(spec_dict())) == []


@pytest.mark.parametrize(
    "path, value, problem_at",
    [
        # The runtime's own cross-field rules, re-rooted: G*N = 32 samples over DP 3; DP beyond devices.
        ("job.training.data_parallel_size", 3, "spec.job.training.data_parallel_size"),
        ("job.training.data_parallel_size", 32, "spec.job.training.data_parallel_size"),
        ("job.evaluation", {"interval": 5}, "spec.job.evaluation.interval"),  # no held-out prompts
        ("job.model", {"path": "/models/qwen"}, "spec.job.data"),  # a model of the user's, the demo's data
        ("job.resources.accelerator_resource", "CPU", "spec.job.resources.accelerator_resource"),
        # Storage: exactly one source, sane paths.
        ("checkpoint", {"claimName": "pvc", "hostPath": "/mnt/rl"}, "spec.checkpoint"),
        ("checkpoint", {"mountPath": "/ckpt"}, "spec.checkpoint"),
        ("checkpoint", {"hostPath": "relative/dir"}, "spec.checkpoint.hostPath"),
        ("checkpoint", {"claimName": "pvc", "mountPath": "ckpt"}, "spec.checkpoint.mountPath"),
        ("checkpoint", {"claimName": "pvc", "mountPath": "/"}, "spec.checkpoint.mountPath"),
        ("checkpoint", {"claimName": "pvc", "mountPath": "/etc/rldock/ckpt"}, "spec.checkpoint.mountPath"),
        ("checkpoint", {"claimName": "pvc", "mountPath": "/dev"}, "spec.checkpoint.mountPath"),
        # Device resource names: domain/name, outside kubernetes.io.
        ("cluster.deviceResource", "Ascend910", "spec.cluster.deviceResource"),
        ("cluster.deviceResource", "Huawei.com/Ascend910", "spec.cluster.deviceResource"),
        ("cluster.deviceResource", "huawei.com/", "spec.cluster.deviceResource"),
        ("cluster.deviceResource", "kubernetes.io/npu", "spec.cluster.deviceResource"),
        ("cluster.deviceResource", "huawei.com/Ascend 910", "spec.cluster.deviceResource"),
        ("cluster.head", {"cpu": "2k", "memory": "8Gi"}, "spec.cluster.head.cpu"),
        # Tolerations and node selectors the API server would refuse on the pods.
        ("cluster.tolerations", [{"operator": "Equal", "value": "x"}], "spec.cluster.tolerations[0].operator"),
        (
            "cluster.tolerations",
            [{"key": "a", "operator": "Exists", "value": "x"}],
            "spec.cluster.tolerations[0].value",
        ),
        (
            "cluster.tolerations",
            [{"key": "a", "tolerationSeconds": 5}],
            "spec.cluster.tolerations[0].tolerationSeconds",
        ),
        ("cluster.tolerations", [{"key": "bad key!", "operator": "Exists"}], "spec.cluster.tolerations[0].key"),
        ("cluster.nodeSelector", {"-bad": "x"}, "spec.cluster.nodeSelector[-bad]"),
        ("cluster.nodeSelector", {"zone": "not valid!"}, "spec.cluster.nodeSelector[zone]"),
        # A rollout pool's pods sized for a job without a pool.
        ("cluster.pool", {"cpu": 4, "memory": "32Gi"}, "spec.cluster.pool"),
        # Scheduling.
        ("scheduling", {"gang": "kueue"}, "spec.scheduling.queue"),
        ("scheduling", {"queue": "q"}, "spec.scheduling.queue"),
        ("scheduling", {"gang": "volcano", "schedulerName": "default-scheduler"}, "spec.scheduling.schedulerName"),
        # What does not parse at all is reported, not raised.
        ("backoffLimit", -1, "spec.backoffLimit"),
        ("cluster.gpus", 1, "spec.cluster.gpus"),
        ("job.algorithm", DELETE, "spec.job.algorithm"),
        # The benchmarks' switches are no RLJob fields (JobConfig.ablations, set in code).
        ("job.dock.shared_memory", False, "spec.job.dock.shared_memory"),
        ("job.algorithm.fuse_reward_advantage", False, "spec.job.algorithm.fuse_reward_advantage"),
    ],
)
def test_problems_name_the_field(path, value, problem_at):
    paths = _paths(set_path(spec_dict(), path, value))
    assert problem_at in paths, paths


@pytest.mark.parametrize(
    "path, value",
    [
        ("cluster.deviceResource", "nvidia.com/gpu"),
        ("cluster.deviceResource", "example.org/my_npu.v2"),
        ("cluster.tolerations", [{"operator": "Exists"}]),
        ("cluster.tolerations", [{"key": "k", "value": "v", "effect": "NoExecute", "tolerationSeconds": 30}]),
        ("cluster.nodeSelector", {"node.kubernetes.io/instance-type": "ascend-910b", "empty": ""}),
        ("scheduling", {"gang": "volcano"}),
        ("scheduling", {"gang": "volcano", "queue": "q", "schedulerName": "volcano"}),
        ("checkpoint", {"hostPath": "/mnt/rl", "mountPath": "/data/ckpt"}),
        ("cluster.head", {"cpu": "500m", "memory": "8Gi"}),
    ],
)
def test_valid_variants_pass(path, value):
    assert _paths(set_path(spec_dict(), path, value)) == []


def test_a_rollout_pools_pod_size_is_checked_as_the_workers_is():
    raw = set_path(spec_dict(), "job.rollout", {"pool": {"replicas": 2}})
    assert _paths(set_path(raw, "cluster.pool", {"cpu": "500m", "memory": "16Gi"})) == []
    _, problems = parse_spec(set_path(raw, "cluster.pool", {"cpu": "2k", "memory": "8Gi"}))
    assert [p.path for p in problems] == ["spec.cluster.pool.cpu"]
    assert 'such as 4, "0.5" or "500m"' in problems[0].message


def test_every_problem_is_reported_at_once():
    raw = set_path(spec_dict(), "job.training.data_parallel_size", 3)
    raw = set_path(raw, "checkpoint", {})
    raw = set_path(raw, "cluster.deviceResource", "npu")
    _, problems = parse_spec(raw)
    assert [p.path for p in problems] == [
        "spec.job.training.data_parallel_size",
        "spec.cluster.deviceResource",
        "spec.checkpoint",
    ]
    assert all(p.message for p in problems)
    assert "G*N" in problems[0].message  # the runtime's own message, unchanged


def test_the_example_in_the_docs_is_valid():
    text = (Path(__file__).resolve().parents[3] / "docs" / "operator.md").read_text()
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, re.S).group(1))
    assert example["kind"] == "RLJob"
    assert _paths(example["spec"]) == []


@pytest.mark.parametrize(
    "path, value, problem_at, says",
    [
        ("image", "ghcr.io/rldock/runtime:1 0", "spec.image", "is not an image reference such as"),
        ("image", "x" * 600, "spec.image", "at most 512"),
        (
            "cluster.worker",
            {"cpu": -4, "memory": "8Gi"},
            "spec.cluster.worker.cpu",
            'such as 4, or a quoted amount such as "500m"',
        ),
        ("cluster.head", {"cpu": "lots", "memory": "8Gi"}, "spec.cluster.head.cpu", "'lots' is not a quantity"),
        ("job.model.path", "/m" * 2049, "spec.job.model.path", "at most 4096"),
    ],
)
def test_refusals_say_what_a_valid_value_looks_like(path, value, problem_at, says):
    """Before: a negative cpu failed with pydantic's union-branch noise (`cpu.constrained-int`)."""
    _, problems = parse_spec(set_path(spec_dict(), path, value))
    assert [p.path for p in problems] == [problem_at]
    assert says in problems[0].message and "constrained" not in problems[0].message


@pytest.mark.parametrize("limit, too_large", [(CONFIG_MAP_MAX_BYTES, False), (100, True)])
def test_a_job_config_that_cannot_fit_its_configmap_is_a_spec_problem(limit, too_large):
    spec = RLJobSpec.model_validate(spec_dict())
    problems = job_config_size_problems(spec, limit=limit)
    assert bool(problems) is too_large
    assert all(p.path == "spec.job" and f"at most {limit}" in p.message for p in problems)


# --- spec.environments and the job config's servers ---------------------------------------------------


def _agent_job(environment: dict | None = None, sandbox: dict | None = None) -> dict:
    job = spec_dict()["job"]
    job["data"] = {"generator": {"name": "addition"}, "chat_template": "model"}
    job["algorithm"]["max_response_length"] = 512
    job["agent"] = {"tools": [{"name": "python"}]}
    if environment is not None:
        job["agent"]["environment"] = {"name": "openenv", "servers": environment}
    if sandbox is not None:
        job["agent"]["sandbox"] = {"servers": sandbox}
    return job


ENVIRONMENTS = [{"name": "cabinet", "image": "registry.example.com/envs/cabinet:1"}, {"name": "sandbox"}]


@pytest.mark.parametrize(
    "job, environments, problems",
    [
        (_agent_job({"service": "cabinet"}, {"service": "sandbox"}), ENVIRONMENTS, []),
        (_agent_job({"url": "http://envs.example.com:8000"}), [], []),  # servers running elsewhere
        (
            _agent_job({"service": "x"}),
            ENVIRONMENTS,
            ["spec.job.agent.environment.servers.service: 'x' is not in spec.environments (cabinet, sandbox)"],
        ),
        (
            _agent_job(sandbox={"service": "cabinet-2"}),
            [],
            ["spec.job.agent.sandbox.servers.service: 'cabinet-2' is not in spec.environments (none)"],
        ),
        (
            _agent_job({"command": ["my-env", "--port", "{port}"]}),
            [],
            [
                "spec.job.agent.environment.servers.command: in an RLJob a command would start the servers inside "
                "the Ray head pod, beside the job's credentials, model and Ray session; run them as pods: add a "
                "spec.environments entry and name it with servers.service"
            ],
        ),
        (
            _agent_job({"service": "cabinet", "sessions_per_replica": 4}),
            ENVIRONMENTS,
            [
                "spec.job.agent.environment.servers.sessions_per_replica: a service's sessions per replica are its "
                "spec.environments entry's sessionsPerReplica; set them there"
            ],
        ),
        (
            _agent_job({"service": "cabinet"}),
            [*ENVIRONMENTS, {"name": "cabinet"}],
            ["spec.environments[2].name: 'cabinet' also names spec.environments[0]"],
        ),
        (
            spec_dict()["job"],
            [
                {
                    "name": "a",
                    "env": [
                        {"name": "9LIVES", "value": "x"},
                        {"name": "K", "value": "v"},
                        {"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                    ],
                }
            ],
            [
                "spec.environments[0].env[0].name: '9LIVES' is not a valid variable name",
                "spec.environments[0].env[2].name: 'K' is also set by spec.environments[0].env[1]",
            ],
        ),
        (
            spec_dict()["job"],
            [{"name": "a", "env": [{"name": "RLDOCK_ENV_TOKEN", "value": "a-token-the-author-knows"}]}],
            [
                "spec.environments[0].env[0].name: RLDOCK_ENV_TOKEN is the job's environment token, which the "
                "operator sets from a Secret of its own; remove it (the server reads it as given)"
            ],
        ),
        (
            spec_dict()["job"],
            [
                {
                    "name": "a",
                    "env": [{"name": "K", "value": "v", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}],
                    "resources": {"cpu": "2k", "memory": "1Gi"},
                }
            ],
            [
                'spec.environments[0].resources.cpu: \'2k\' is not a CPU amount such as 4, "0.5" or "500m"',
                "spec.environments[0].env[0]: set value or valueFrom, not both",
            ],
        ),
    ],
    ids=[
        "services",
        "url",
        "unknown-service",
        "no-environments",
        "command",
        "sessions-twice",
        "duplicate",
        "env-names",
        "token",
        "cpu-and-env-value",
    ],
)
def test_environments_and_the_servers_that_name_them(job, environments, problems):
    _, found = parse_spec(spec_dict(job=job, environments=environments))
    assert [str(p) for p in found] == problems


@pytest.mark.parametrize(
    "environment, error_at",
    [
        ({"name": "Cabinet"}, "spec.environments.0.name"),  # a DNS label: the Service's name and servers.service
        ({"name": "a", "port": 0}, "spec.environments.0.port"),
        ({"name": "a", "replicas": 0}, "spec.environments.0.replicas"),
        ({"name": "a", "image": "no spaces allowed"}, "spec.environments.0.image"),
        ({"name": "a", "volumes": []}, "spec.environments.0.volumes"),  # nothing beyond the fields listed
    ],
)
def test_the_schema_refuses_bad_entries(environment, error_at):
    _, found = parse_spec(spec_dict(environments=[environment]))
    assert [p.path for p in found] == [error_at.replace(".0.", "[0].")]
