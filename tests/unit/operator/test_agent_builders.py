"""Builders of spec.agents (builders/agents.py over builders/pod_sets.py): each entry's Deployment and
NetworkPolicy and the job's runner ConfigMap and gateway Service, checked with kubernetes-validate and the
`restricted` checker; the policies that let an agent pod reach its job's gateway port and environments and
nothing else; the admin's policy (images, policy.agents bounds) and the spec checks; the job config the
runtime reads (agent.harness_pods)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from rljob_testing import KUBERNETES_VERSION, job_dict, spec_dict

import rldock.contract.agent_runner as agent_runner
from rldock.contract.agent_pods import GATEWAY_ENV, GATEWAY_PORT
from rldock.operator import naming
from rldock.operator.api import RLJobSpec
from rldock.operator.builders import (
    RLJobRef,
    build_agent,
    build_agent_runner_config_map,
    build_environment,
    build_gateway_service,
    build_network_policy,
    build_ray_cluster,
    runtime_job_config,
)
from rldock.operator.policy import AdminPolicy, policy_problems
from rldock.operator.validation import parse_spec
from rldock_e2e.pod_security import restricted_violations

JOB = RLJobRef(name="agent-demo", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")
PREFIX = "registry.example.com/agents/"
AGENT = {
    "name": "solver",
    "image": f"{PREFIX}solver:1",
    "command": ["python", "/app/agent.py"],
    "replicas": 2,
    "episodesPerReplica": 4,
    "resources": {"cpu": "500m", "memory": "512Mi"},
    "env": [{"name": "LOG_LEVEL", "value": "info"}],
}
CABINET = {"name": "cabinet", "image": "registry.example.com/envs/cabinet:1", "port": 9000}


def _spec(**sections: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(spec_dict(**sections))


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) selecting `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", ()))


def _pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("sections", [{"agents": [AGENT]}, {"agents": [AGENT], "suspend": True}])
def test_every_child_is_a_valid_object_owned_by_the_rljob(sections):
    spec = _spec(**sections)
    children = [*build_agent(job=JOB, spec=spec, agent=spec.agents[0])]
    children += [build_agent_runner_config_map(job=JOB), build_gateway_service(job=JOB)]
    for manifest in children:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        (owner,) = manifest["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", JOB.uid, True)
        assert manifest["metadata"]["namespace"] == JOB.namespace
    assert children[1]["spec"]["replicas"] == (0 if spec.suspend else 2)


def test_the_agent_pod_template_is_restricted_without_a_token_and_runs_the_runner():
    spec = _spec(agents=[AGENT])
    deployment = build_agent(job=JOB, spec=spec, agent=spec.agents[0]).deployment
    template = deployment["spec"]["template"]
    assert restricted_violations(template["spec"], template["metadata"].get("annotations")) == []
    pod = template["spec"]
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    assert pod["serviceAccountName"] == naming.environment_service_account_name(JOB.name)
    (container,) = pod["containers"]
    assert container["image"] == AGENT["image"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["command"] == ["python3", "/etc/rldock-agent/agent_runner.py"]
    assert container["args"] == ["--episodes", "4", "--", "python", "/app/agent.py"]
    env = {var["name"]: var for var in container["env"]}
    assert env["LOG_LEVEL"]["value"] == "info"
    assert env[GATEWAY_ENV]["value"] == f"{naming.gateway_service_name(JOB.name)}.team-a.svc.cluster.local:8300"
    assert env["RLDOCK_ENV_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == naming.environment_token_secret_name(
        JOB.name, JOB.uid
    )
    # The runner is the contract's file, mounted read-only from the job's ConfigMap.
    runner = build_agent_runner_config_map(job=JOB)
    assert runner["data"]["agent_runner.py"] == Path(agent_runner.__file__).read_text()
    volume = next(v for v in pod["volumes"] if "configMap" in v)
    assert volume["configMap"]["name"] == runner["metadata"]["name"]
    mount = next(m for m in container["volumeMounts"] if m["name"] == volume["name"])
    assert mount == {"name": volume["name"], "mountPath": "/etc/rldock-agent", "readOnly": True}
    # Not a Ray pod: no `rldock.io/rljob` label, which the Ray pods' policy admits on every port.
    assert "rldock.io/rljob" not in _pod_labels(deployment)


def test_an_agent_reaches_only_its_job_s_gateway_port_its_environments_and_dns():
    spec = _spec(agents=[AGENT], environments=[CABINET])
    agent = build_agent(job=JOB, spec=spec, agent=spec.agents[0])
    agent_labels = _pod_labels(agent.deployment)
    policy = agent.network_policy["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in policy
    assert _selects(policy["podSelector"], agent_labels)
    dns, gateway, environments = policy["egress"]
    assert [p["port"] for p in dns["ports"]] == [53, 53]
    cluster = build_ray_cluster(job=JOB, spec=spec)
    ray_pods = [cluster["spec"]["headGroupSpec"]["template"], cluster["spec"]["workerGroupSpecs"][0]["template"]]
    other = build_ray_cluster(job=RLJobRef(name="other", namespace=JOB.namespace, uid="u2"), spec=spec)
    assert gateway["ports"] == [{"protocol": "TCP", "port": GATEWAY_PORT}]
    (peer,) = gateway["to"]
    assert all(_selects(peer["podSelector"], pod["metadata"]["labels"]) for pod in ray_pods)
    assert not _selects(peer["podSelector"], other["spec"]["headGroupSpec"]["template"]["metadata"]["labels"])
    cabinet = build_environment(job=JOB, spec=spec, environment=spec.environments[0])
    assert environments["ports"] == [{"protocol": "TCP", "port": 9000}]
    assert _selects(environments["to"][0]["podSelector"], _pod_labels(cabinet.deployment))
    # ... and those admit it: the Ray pods on the gateway port only, the environment on its port.
    ray_policy = build_network_policy(job=JOB, operator_namespace=None, operator_pod_labels={}, agents=True)
    admitting = [
        r for r in ray_policy["spec"]["ingress"] if any(_selects(p["podSelector"], agent_labels) for p in r["from"])
    ]
    assert admitting == [{"from": admitting[0]["from"], "ports": [{"protocol": "TCP", "port": GATEWAY_PORT}]}]
    without = build_network_policy(job=JOB, operator_namespace=None, operator_pod_labels={})
    assert not any(_selects(p["podSelector"], agent_labels) for r in without["spec"]["ingress"] for p in r["from"])
    (rule,) = cabinet.network_policy["spec"]["ingress"]
    assert any(_selects(p["podSelector"], agent_labels) for p in rule["from"])
    alone = build_environment(job=JOB, spec=_spec(environments=[CABINET]), environment=spec.environments[0])
    (rule,) = alone.network_policy["spec"]["ingress"]
    assert not any(_selects(p["podSelector"], agent_labels) for p in rule["from"])
    # The gateway Service selects the job's Ray pods, not its agents or another job's pods.
    service = build_gateway_service(job=JOB)["spec"]
    assert service["clusterIP"] == "None" and service["ports"][0]["port"] == GATEWAY_PORT
    assert all(service["selector"].items() <= pod["metadata"]["labels"].items() for pod in ray_pods)
    assert not service["selector"].items() <= agent_labels.items()


def test_the_admin_s_egress_is_added_after_the_operator_s():
    spec = _spec(agents=[AGENT])
    rule = {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443, "protocol": "TCP"}]}
    egress = build_agent(job=JOB, spec=spec, agent=spec.agents[0], egress=[rule]).network_policy["spec"]["egress"]
    assert len(egress) == 3 and egress[-1] == rule


@pytest.mark.parametrize(
    "agent, policy, paths",
    [
        (AGENT, {"imagePrefixes": [PREFIX]}, []),
        (AGENT, {}, ["spec.agents[0].image"]),
        (
            {**AGENT, "image": "registry.example.com/agents-evil/x:1"},
            {"imagePrefixes": [PREFIX]},
            ["spec.agents[0].image"],
        ),
        ({**AGENT, "replicas": 40}, {"imagePrefixes": [PREFIX]}, ["spec.agents[0].replicas", "spec.agents"]),
        (AGENT, {"imagePrefixes": [PREFIX], "agents": {"maxMemory": "256Mi"}}, ["spec.agents[0].resources.memory"]),
        (AGENT, {"imagePrefixes": [PREFIX], "agents": {"maxPods": 1}}, ["spec.agents"]),
        # the environments' bounds are their own: an agent within policy.agents passes whatever they say
        (AGENT, {"imagePrefixes": [PREFIX], "environments": {"maxPods": 1, "maxCpu": "100m"}}, []),
    ],
)
def test_the_admin_s_policy_bounds_the_agents(agent, policy, paths):
    spec = _spec(agents=[agent])
    problems = policy_problems(spec, AdminPolicy.model_validate(policy), default_image="rldock/runtime:1")
    assert [p.path for p in problems] == paths
    for problem in problems:
        assert "policy" in problem.message and (
            "imagePrefixes" in problem.message or "policy.agents" in problem.message
        )


@pytest.mark.parametrize(
    "agent_section, agents, paths",
    [
        (None, [AGENT], []),
        ({"harness_command": ["python", "a.py"]}, [AGENT], ["spec.job.agent.harness_command"]),
        ({"tools": [{"name": "python"}]}, [AGENT], ["spec.job.agent.tools"]),
        ({}, [AGENT], []),
        (None, [], []),
        ({"harness_pods": True}, [], ["spec.job.agent.harness_pods"]),
        (None, [AGENT, AGENT], ["spec.agents[1].name"]),
        (None, [{**AGENT, "env": [{"name": GATEWAY_ENV, "value": "x"}]}], ["spec.agents[0].env[0].name"]),
        (None, [{**AGENT, "env": [{"name": "RLDOCK_ENV_TOKEN", "value": "x"}]}], ["spec.agents[0].env[0].name"]),
    ],
)
def test_the_spec_s_agents_and_job_config_agree(agent_section, agents, paths):
    job = job_dict()
    job["data"] = {"generator": {"name": "addition"}, "chat_template": "model"}
    job["reward"] = {"terms": [{"name": "environment"}]}
    if agent_section is not None:
        job["agent"] = agent_section
    _, problems = parse_spec(spec_dict(job=job, agents=agents))
    found = [p.path for p in problems]
    # (the job config's own rules may add theirs, e.g. tools without a harness want a longer response)
    assert found == paths if not paths else set(paths) <= set(found), problems


def test_the_runtime_reads_harness_pods_set_by_the_operator():
    job = job_dict()
    job["data"] = {"generator": {"name": "addition"}, "chat_template": "model"}
    job["reward"] = {"terms": [{"name": "environment"}]}
    spec, problems = parse_spec(spec_dict(job=job, agents=[AGENT]))
    assert problems == [] and spec is not None
    runtime = runtime_job_config(job=JOB, spec=spec)
    assert runtime.agent is not None and runtime.agent.harness_pods and runtime.agent.harnessed
    assert spec.job.agent is None  # the spec itself is left as written
    plain = parse_spec(spec_dict(job=job))[0]
    assert plain is not None and runtime_job_config(job=JOB, spec=plain).agent is None
