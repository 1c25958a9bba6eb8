"""Builders of spec.environments (builders/environments.py): each entry's Deployment, headless Service,
NetworkPolicy and ServiceAccount, table-driven over spec variants, checked with kubernetes-validate and
the `restricted` checker; the patches the reconciler sends; names no other job's child can take; and
the job config the runtime reads, with every `servers.service` replaced by its Service's URL."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from rljob_testing import KUBERNETES_VERSION, job_dict, spec_dict

from rldock.config import JobConfig, find_problems, parse_job_config
from rldock.operator import naming
from rldock.operator.api import PodDefaults, RLJobSpec
from rldock.operator.builders import (
    RLJobRef,
    build_config_map,
    build_environment,
    build_network_policy,
    build_pod_service_account,
    build_ray_cluster,
    runtime_job_config,
    service_url,
)
from rldock.operator.builders.pod_sets import (
    deployment_patch,
    network_policy_patch,
    service_patch,
    with_replicas,
)
from rldock.operator.builders.ray_cluster import environment_token_env
from rldock.operator.builders.secret import build_environment_token_secret
from rldock.operator.constants import ANNOTATION_SPEC_HASH, JOB_CONFIG_FILE
from rldock.operator.policy import AdminPolicy, policy_problems
from rldock.operator.validation import parse_spec
from rldock_e2e.pod_security import restricted_violations

JOB = RLJobRef(name="agent-demo", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")
SANDBOX = {
    "name": "sandbox",
    "command": [
        "rldock",
        "env",
        "serve",
        "rldock.runtime.agent.sandbox_service:PythonSandbox",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ],
}
CABINET = {
    "name": "cabinet",
    "image": "registry.example.com/envs/cabinet:1.2",
    "args": ["--workers", "2"],
    "port": 9000,
    "replicas": 3,
    "sessionsPerReplica": 16,
    "resources": {"cpu": "500m", "memory": "512Mi"},
    "env": [
        {"name": "LOG_LEVEL", "value": "info"},
        {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "cabinet", "key": "key"}}},
    ],
}
ADMIN = PodDefaults(
    labels={"team": "ml", "rldock.io/environment": "spoofed"},
    annotations={"cost-center": "42"},
    priority_class_name="research",
    image_pull_secrets=("registry",),
)

# (spec sections, pod defaults): what an RLJob author and an admin can vary.
VARIANTS: dict[str, tuple[dict[str, Any], PodDefaults]] = {
    "runtime-image": ({"environments": [SANDBOX]}, PodDefaults()),
    "own-image": ({"environments": [CABINET]}, PodDefaults()),
    "admin-defaults": ({"environments": [CABINET], "imagePullSecrets": [{"name": "mine"}]}, ADMIN),
    "suspended": ({"environments": [SANDBOX, CABINET], "suspend": True}, PodDefaults()),
}


def _spec(**sections: Any) -> RLJobSpec:
    return RLJobSpec.model_validate(spec_dict(**sections))


def _children(variant: str) -> list[tuple[RLJobSpec, Any]]:
    sections, defaults = VARIANTS[variant]
    spec = _spec(**sections)
    return [
        (spec, build_environment(job=JOB, spec=spec, environment=environment, defaults=defaults))
        for environment in spec.environments
    ]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) selecting `labels`."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", ()):
        assert expression["operator"] == "In"
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return True


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_child_is_a_valid_object_owned_by_the_rljob(variant):
    for _, children in _children(variant):
        for manifest in children:
            kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
            (owner,) = manifest["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["uid"], owner["controller"]) == ("RLJob", JOB.uid, True)
            assert manifest["metadata"]["labels"]["rldock.io/rljob"] == JOB.name
            assert manifest["metadata"]["namespace"] == JOB.namespace
        assert len({manifest["metadata"]["name"] for manifest in children}) == 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_environment_pod_template_is_restricted_without_a_token(variant):
    for _, children in _children(variant):
        template = children.deployment["spec"]["template"]
        assert restricted_violations(template["spec"], template["metadata"].get("annotations")) == []
        assert template["spec"]["automountServiceAccountToken"] is False
        assert template["spec"]["enableServiceLinks"] is False
        # Its own ServiceAccount, never the namespace's `default`, and that one mounts no token either.
        account = build_pod_service_account(job=JOB)
        kubernetes_validate.validate(account, KUBERNETES_VERSION, strict=True)
        assert template["spec"]["serviceAccountName"] == account["metadata"]["name"]
        assert account["automountServiceAccountToken"] is False and set(account) == {
            "apiVersion",
            "kind",
            "metadata",
            "automountServiceAccountToken",
        }
        # Only /tmp is writable, sized, and nothing of the Ray pods is mounted (job config, checkpoints, token).
        (container,) = template["spec"]["containers"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        size = container["resources"]["limits"]["ephemeral-storage"]
        assert template["spec"]["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": size}}]
        assert container["resources"]["requests"]["ephemeral-storage"] == size
        secrets = [(var.get("valueFrom") or {}).get("secretKeyRef", {}).get("name", "") for var in container["env"]]
        assert naming.auth_secret_name(JOB.name, JOB.uid) not in secrets
        # ... but the job's environment token, last, so no entry's env can replace it.
        assert container["env"][-1] == {
            "name": "RLDOCK_ENV_TOKEN",
            "valueFrom": {
                "secretKeyRef": {"name": naming.environment_token_secret_name(JOB.name, JOB.uid), "key": "token"}
            },
        }


@pytest.mark.parametrize(
    "variant, name, image, replicas, port, command, args",
    [
        ("runtime-image", "sandbox", "ghcr.io/rldock/rldock-runtime", 1, 8000, SANDBOX["command"], None),
        ("own-image", "cabinet", CABINET["image"], 3, 9000, None, ["--workers", "2"]),
        ("suspended", "sandbox", "ghcr.io/rldock/rldock-runtime", 0, 8000, SANDBOX["command"], None),
        ("suspended", "cabinet", CABINET["image"], 0, 9000, None, ["--workers", "2"]),
    ],
)
def test_the_deployment_runs_the_entry(variant, name, image, replicas, port, command, args):
    spec, children = next(
        (s, c) for s, c in _children(variant) if c.deployment["metadata"]["labels"]["rldock.io/environment"] == name
    )
    deployment = children.deployment
    assert deployment["metadata"]["name"] == naming.environment_name(JOB.name, name)
    assert re.fullmatch(f"{JOB.name}-env-{name}-[0-9a-f]{{16}}", deployment["metadata"]["name"])
    assert deployment["spec"]["replicas"] == replicas  # 0 while the RLJob is suspended
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"].startswith(image)
    assert container.get("command") == command and container.get("args") == args
    assert container["ports"] == [{"name": "http", "containerPort": port, "protocol": "TCP"}]
    probe = container["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/health", "http")
    assert container["resources"]["requests"] == container["resources"]["limits"]


def test_the_entry_s_env_resources_and_the_admin_s_defaults_reach_its_pods():
    ((_, children),) = _children("admin-defaults")
    template = children.deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    assert container["env"][:-1] == CABINET["env"]
    assert container["resources"]["limits"] == {"cpu": "500m", "memory": "512Mi", "ephemeral-storage": "1Gi"}
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"]["rldock.io/environment"] == "cabinet"  # the operator's label wins
    assert template["metadata"]["annotations"] == {"cost-center": "42"}
    assert template["spec"]["priorityClassName"] == "research"
    assert template["spec"]["imagePullSecrets"] == [{"name": "registry"}, {"name": "mine"}]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_headless_service_selects_exactly_the_entry_s_pods(variant):
    deployments = [children.deployment for _, children in _children(variant)]
    for _, children in _children(variant):
        service = children.service["spec"]
        assert service["clusterIP"] == "None" and service["publishNotReadyAddresses"] is False
        port = children.deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
        assert service["ports"] == [{"name": "http", "port": port, "targetPort": port, "protocol": "TCP"}]
        assert service["selector"] == children.deployment["spec"]["selector"]["matchLabels"]
        selected = [
            d for d in deployments if service["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert selected == [children.deployment]


@pytest.mark.parametrize("variant", VARIANTS)
def test_only_the_job_s_ray_pods_reach_an_environment_and_environments_reach_no_ray_pod(variant):
    spec = _children(variant)[0][0]
    cluster = build_ray_cluster(job=JOB, spec=spec)
    ray_pods = [cluster["spec"]["headGroupSpec"]["template"]] + [
        group["template"] for group in cluster["spec"]["workerGroupSpecs"]
    ]
    other_job = build_ray_cluster(job=RLJobRef(name="other", namespace=JOB.namespace, uid="u2"), spec=spec)
    ray_policy = build_network_policy(job=JOB, operator_namespace=None, operator_pod_labels={})["spec"]
    for _, children in _children(variant):
        policy = children.network_policy["spec"]
        env_labels = children.deployment["spec"]["template"]["metadata"]["labels"]
        port = children.deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
        assert policy["policyTypes"] == ["Ingress", "Egress"] and _selects(policy["podSelector"], env_labels)
        (rule,) = policy["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": port}]
        (peer,) = rule["from"]
        assert set(peer) == {"podSelector"}  # this namespace only
        assert all(_selects(peer["podSelector"], pod["metadata"]["labels"]) for pod in ray_pods)
        assert not _selects(peer["podSelector"], env_labels)
        assert not _selects(peer["podSelector"], other_job["spec"]["headGroupSpec"]["template"]["metadata"]["labels"])
        # The Ray pods' own policy neither covers the environment's pods nor admits them.
        assert not _selects(ray_policy["podSelector"], env_labels)
        assert not any(_selects(p["podSelector"], env_labels) for r in ray_policy["ingress"] for p in r["from"])


def test_the_environment_pods_reach_only_the_cluster_dns_and_what_the_admin_lists():
    spec = _spec(environments=[CABINET])
    dns_only = build_environment(job=JOB, spec=spec, environment=spec.environments[0]).network_policy["spec"]
    (dns,) = dns_only["egress"]
    assert dns == {
        "to": [
            {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
            }
        ],
        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
    }
    policy = AdminPolicy.model_validate(
        {"environments": {"egress": [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 443}]}]}}
    )
    rules = [rule.manifest() for rule in policy.environments.egress]
    assert rules == [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 443}]}]
    listed = build_environment(job=JOB, spec=spec, environment=spec.environments[0], egress=rules).network_policy
    kubernetes_validate.validate(listed, KUBERNETES_VERSION, strict=True)
    assert listed["spec"]["egress"] == [dns, *rules]


@pytest.mark.parametrize(
    "scheduling, labels, annotations, scheduler",
    [
        ({}, {}, {}, None),
        ({"schedulerName": "my-scheduler"}, {}, {}, "my-scheduler"),
        ({"gang": "kueue", "queue": "team-a"}, {"kueue.x-k8s.io/queue-name": "team-a"}, {}, None),
        ({"gang": "volcano", "queue": "q1"}, {}, {"scheduling.volcano.sh/queue-name": "q1"}, "volcano"),
        ({"gang": "volcano"}, {}, {}, "volcano"),
    ],
    ids=["default", "own-scheduler", "kueue", "volcano-queue", "volcano"],
)
def test_the_environment_pods_carry_the_job_s_queue_and_scheduler(scheduling, labels, annotations, scheduler):
    spec = _spec(environments=[CABINET], scheduling=scheduling)
    deployment = build_environment(job=JOB, spec=spec, environment=spec.environments[0]).deployment
    kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    template = deployment["spec"]["template"]
    assert labels.items() <= template["metadata"]["labels"].items()
    assert labels.items() <= deployment["metadata"]["labels"].items()  # Kueue's Deployment integration reads these
    assert "kueue.x-k8s.io/queue-name" not in template["metadata"]["labels"] or labels
    assert (template["metadata"].get("annotations") or {}) == annotations
    assert template["spec"].get("schedulerName") == scheduler


def test_before_admission_the_deployment_asks_for_no_pod_and_keeps_its_hash():
    spec = _spec(environments=[CABINET])
    deployment = build_environment(job=JOB, spec=spec, environment=spec.environments[0]).deployment
    queued = with_replicas(deployment, 0)
    assert (queued["spec"]["replicas"], deployment["spec"]["replicas"]) == (0, 3)  # the built one is left as it was
    assert queued["metadata"] == deployment["metadata"]
    assert deployment_patch(deployment, queued) == {"spec": {"replicas": 0}}


def test_a_stray_pod_with_the_readable_labels_joins_no_service():
    spec = _spec(environments=[CABINET])
    children = build_environment(job=JOB, spec=spec, environment=spec.environments[0])
    own = children.deployment["spec"]["template"]["metadata"]["labels"]
    stray = {key: value for key, value in own.items() if key != "rldock.io/environment-of-uid"}
    recreated = {**own, "rldock.io/environment-of-uid": "another-uid"}  # an RLJob of the same name, made again
    selector = children.service["spec"]["selector"]
    assert selector.items() <= own.items()
    assert not selector.items() <= stray.items() and not selector.items() <= recreated.items()
    assert selector == children.deployment["spec"]["selector"]["matchLabels"]
    assert children.network_policy["spec"]["podSelector"]["matchLabels"] == selector


# Pairs of RLJobs whose names an attacker picks so that one's child would take the other's name:
# (RLJob, environment entry) against a name the other job's children (rldock's or KubeRay's) have.
COLLISIONS = [
    (("math", "v2-head-svc"), naming.head_service_name("math-env-v2")),  # the victim's KubeRay head Service
    (("math", "v2-serve-svc"), f"{naming.ray_cluster_name('math-env-v2')}-serve-svc"),
    (("a", "b-ray"), naming.network_policy_name("a-env-b")),  # the other job's Ray NetworkPolicy
    (("a", "b-env-c"), naming.environment_name("a-env-b", "c")),  # another job's environment
    (("a", "x"), naming.environment_name("b", "x")),
    (("a" * 60, "x"), naming.network_policy_name("a" * 60 + "-env-x")),  # both shortened
    (("a", "x"), naming.environment_service_account_name("a-env-x")),
]


@pytest.mark.parametrize("attacker, victim_name", COLLISIONS)
def test_no_environment_child_can_take_another_job_s_name(attacker, victim_name):
    name = naming.environment_name(*attacker)
    # Not only unequal: the last parts differ, 16 hex digits of the attacker's own (RLJob, entry)
    # against a fixed ending (`svc`, `ray`), a shortened name's 8 hex digits or another pair's hash.
    assert re.fullmatch(r".*-[0-9a-f]{16}", name)
    assert name.rsplit("-", 1)[1] != victim_name.rsplit("-", 1)[1]


def test_the_token_secret_and_service_account_are_the_job_s():
    secret = build_environment_token_secret(job=JOB, token="t" * 43)
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    assert secret["metadata"]["name"] == naming.environment_token_secret_name(JOB.name, JOB.uid)
    assert secret["stringData"] == {"token": "t" * 43}
    with pytest.raises(ValueError, match="must not be empty"):
        build_environment_token_secret(job=JOB, token="")
    # The Ray pods' clients read the same Secret, and only a job with environments has one.
    for sections, expected in (({"environments": [CABINET]}, True), ({}, False)):
        cluster = build_ray_cluster(job=JOB, spec=_spec(**sections))
        for template in [cluster["spec"]["headGroupSpec"]["template"]] + [
            group["template"] for group in cluster["spec"]["workerGroupSpecs"]
        ]:
            (container,) = template["spec"]["containers"]
            tokens = [var for var in container["env"] if var["name"] == "RLDOCK_ENV_TOKEN"]
            assert tokens == ([environment_token_env(JOB)] if expected else [])


def test_children_are_deterministic_and_the_hash_ignores_the_replica_count():
    running = _spec(environments=[CABINET])
    suspended = _spec(environments=[CABINET], suspend=True)
    changed = _spec(environments=[{**CABINET, "image": "registry.example.com/envs/cabinet:1.3"}])

    def children(spec):
        return build_environment(job=JOB, spec=spec, environment=spec.environments[0])

    assert children(running) == children(running)
    base, same, other = (children(spec).deployment for spec in (running, suspended, changed))
    assert (
        base["metadata"]["annotations"][ANNOTATION_SPEC_HASH] == same["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    )
    assert (
        base["metadata"]["annotations"][ANNOTATION_SPEC_HASH] != other["metadata"]["annotations"][ANNOTATION_SPEC_HASH]
    )


@pytest.mark.parametrize(
    "stored_sections, stored_defaults, desired_sections, expected",
    [
        ({"environments": [CABINET]}, PodDefaults(), {"environments": [CABINET]}, None),
        ({"environments": [CABINET]}, PodDefaults(), {"environments": [CABINET], "suspend": True}, "replicas 0"),
        ({"environments": [CABINET], "suspend": True}, PodDefaults(), {"environments": [CABINET]}, "replicas 3"),
        ({"environments": [CABINET]}, ADMIN, {"environments": [{**CABINET, "image": "r.example.com/c:2"}]}, "spec"),
    ],
    ids=["unchanged", "suspended", "resumed", "new-image-and-no-admin-defaults"],
)
def test_the_deployment_patch_sends_what_changed(stored_sections, stored_defaults, desired_sections, expected):
    stored_spec, spec = _spec(**stored_sections), _spec(**desired_sections)
    stored = build_environment(
        job=JOB, spec=stored_spec, environment=stored_spec.environments[0], defaults=stored_defaults
    ).deployment
    stored["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 30  # what the API server adds
    stored["status"] = {"readyReplicas": 3}
    desired = build_environment(job=JOB, spec=spec, environment=spec.environments[0]).deployment
    patch = deployment_patch(stored, desired)
    if expected is None or expected.startswith("replicas"):
        assert patch == (None if expected is None else {"spec": {"replicas": int(expected.split()[1])}})
        return
    assert patch["metadata"]["annotations"] == desired["metadata"]["annotations"]
    assert patch["spec"]["template"]["spec"]["containers"] == desired["spec"]["template"]["spec"]["containers"]
    # What the admin's defaults added before and the desired object lacks now is removed, not kept.
    assert patch["spec"]["template"]["spec"]["imagePullSecrets"] is None
    assert patch["spec"]["template"]["spec"]["priorityClassName"] is None
    assert patch["spec"]["template"]["metadata"]["annotations"] is None


def test_the_service_and_policy_patches_put_back_what_changed():
    spec = _spec(environments=[CABINET])
    children = build_environment(job=JOB, spec=spec, environment=spec.environments[0])
    stored_service = copy.deepcopy(children.service)
    stored_service["spec"].update(type="ClusterIP", sessionAffinity="None")  # defaulted by the API server
    assert service_patch(stored_service, children.service) is None
    moved = _spec(environments=[{**CABINET, "port": 9001}])
    desired = build_environment(job=JOB, spec=moved, environment=moved.environments[0])
    patch = service_patch(stored_service, desired.service)
    assert patch is not None and "clusterIP" not in patch["spec"]  # immutable
    assert patch["spec"]["ports"][0]["port"] == 9001
    assert network_policy_patch(children.network_policy, children.network_policy) is None
    edited = copy.deepcopy(children.network_policy)
    edited["spec"]["ingress"] = [{}]  # opened to everyone by hand
    assert network_policy_patch(edited, children.network_policy) == {"spec": children.network_policy["spec"]}


# --- the job config the runtime reads ---------------------------------------------------------------


def _agent_job(environment_servers: dict | None, sandbox_servers: dict | None = None) -> dict[str, Any]:
    job = job_dict()
    job["data"] = {"generator": {"name": "addition"}, "chat_template": "model"}
    job["algorithm"]["max_response_length"] = 512
    job["agent"] = {"tools": [{"name": "python"}]}
    if environment_servers is not None:
        job["agent"]["environment"] = {"name": "openenv", "servers": environment_servers}
    if sandbox_servers is not None:
        job["agent"]["sandbox"] = {"servers": sandbox_servers}
    return job


SERVICE_CASES = [
    # (environment servers, sandbox servers, the url and sessions the runtime gets for each, None: unchanged)
    (
        {"service": "cabinet"},
        None,
        (f"http://{naming.environment_name('agent-demo', 'cabinet')}.team-a.svc.cluster.local:9000", 16),
        None,
    ),
    (
        {"service": "cabinet", "startup_timeout_s": 600},
        {"service": "sandbox"},
        (f"http://{naming.environment_name('agent-demo', 'cabinet')}.team-a.svc.cluster.local:9000", 16),
        (f"http://{naming.environment_name('agent-demo', 'sandbox')}.team-a.svc.cluster.local:8000", 8),
    ),
    (
        {"url": "http://envs.example.com:8000", "sessions_per_replica": 4},
        None,
        ("http://envs.example.com:8000", 4),
        None,
    ),
]


@pytest.mark.parametrize("environment_servers, sandbox_servers, environment_gets, sandbox_gets", SERVICE_CASES)
def test_the_runtime_reads_the_service_s_url_never_the_service(
    environment_servers, sandbox_servers, environment_gets, sandbox_gets
):
    spec = _spec(job=_agent_job(environment_servers, sandbox_servers), environments=[SANDBOX, CABINET])
    config_map = build_config_map(job=JOB, spec=spec)
    text = config_map["data"][JOB_CONFIG_FILE]
    rendered = yaml.safe_load(text)
    assert "service: " not in text.replace("service: null", "")
    resolved = JobConfig.model_validate(rendered)
    assert [p for p in find_problems(resolved) if ".servers" in p.path and "replicas" not in p.path] == []
    servers = resolved.agent.environment.servers
    assert (servers.url, servers.sessions_per_replica, servers.service) == (*environment_gets, None)
    if "startup_timeout_s" in environment_servers:
        assert servers.startup_timeout_s == environment_servers["startup_timeout_s"]  # the rest is kept
    sandbox = resolved.agent.sandbox.servers
    if sandbox_gets is None:
        assert sandbox is None
    else:
        assert (sandbox.url, sandbox.sessions_per_replica, sandbox.service) == (*sandbox_gets, None)
    # The spec itself is left as it was (the reconciler compares it round after round).
    assert (
        spec.job.agent.environment.servers.model_dump()
        == _spec(
            job=_agent_job(environment_servers, sandbox_servers), environments=[SANDBOX, CABINET]
        ).job.agent.environment.servers.model_dump()
    )


def test_a_job_without_services_is_passed_through_unchanged():
    plain = _spec()
    assert runtime_job_config(job=JOB, spec=plain) is plain.job
    with_url = _spec(job=_agent_job({"url": "http://envs.example.com:8000"}))
    assert runtime_job_config(job=JOB, spec=with_url) is with_url.job


@pytest.mark.parametrize(
    "rljob, environment",
    [
        ("agent-demo", "cabinet"),
        ("9-starts-with-a-digit", "a"),
        ("a.dotted.name", "env"),
        ("x" * 200, "y" * 63),
    ],
)
def test_the_service_name_is_a_dns_1035_label_and_the_url_uses_it(rljob, environment):
    name = naming.environment_name(rljob, environment)
    assert len(name) <= 63 and name[0].isalpha() and name == name.lower()
    assert all(c.isalnum() or c == "-" for c in name) and not name.endswith("-")
    assert naming.environment_name(rljob, environment) == name  # a restarted operator finds it again
    spec = _spec(environments=[{"name": environment}])
    ref = RLJobRef(name=rljob, namespace="team-a", uid="u")
    assert service_url(ref, spec.environments[0]) == f"http://{name}.team-a.svc.cluster.local:8000"


@pytest.mark.parametrize("environment", [{"name": "feedback"}, {"name": "openenv", "servers": {"service": "cabinet"}}])
def test_the_runtime_accepts_the_job_config_the_operator_writes(environment):
    job = _agent_job(None)
    job["agent"]["environment"] = environment
    spec = _spec(job=job, environments=[CABINET])
    parse_job_config(yaml.safe_load(build_config_map(job=JOB, spec=spec)["data"][JOB_CONFIG_FILE]))


def test_the_example_in_agentic_md_is_valid_and_allowed_with_its_prefix():
    """docs/agentic.md, Environments in an RLJob: its spec (the job's elided sections filled in)."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "agentic.md").read_text()
    section = text.split("## Environments in an RLJob", 1)[1]
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    spec = example["spec"]
    spec["job"] = {**_agent_job(None), "agent": spec["job"]["agent"]}
    parsed, problems = parse_spec(spec)
    assert problems == []
    policy = AdminPolicy(image_prefixes=["registry.example.com/envs/"])
    assert policy_problems(parsed, policy, default_image=PodDefaults().image) == []
    ref = RLJobRef(name=example["metadata"]["name"], namespace=example["metadata"]["namespace"], uid="u")
    resolved = runtime_job_config(job=ref, spec=parsed)
    cabinet = naming.environment_name("agent-demo", "cabinet")
    assert resolved.agent.environment.servers.url == f"http://{cabinet}.team-a.svc.cluster.local:9000"
