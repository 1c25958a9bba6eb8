"""spec.volumes, volumeMounts, env and envFrom: refused where they would clash with what the
operator puts into the pods, and passed into the head and every worker pod where they do not."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from rljob_testing import KUBERNETES_VERSION, error_paths, kuberay_raycluster_validator, spec_dict

from rldock.operator.api import RLJobSpec
from rldock.operator.builders import RLJobRef, build_ray_cluster
from rldock.operator.constants import ENV_ENVIRONMENT_TOKEN, ENV_JOB_CONFIG, ENV_RAY_AUTH_TOKEN, VOLUME_CHECKPOINTS
from rldock.operator.validation import parse_spec

REPO = Path(__file__).resolve().parents[3]
JOB = RLJobRef(name="grpo-data", namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")

# A PVC with models and data, a ConfigMap with a reward function file, a token from a Secret.
INPUTS = {
    "volumes": [
        {"name": "models", "persistentVolumeClaim": {"claimName": "llm-models", "readOnly": True}},
        {"name": "datasets", "nfs": {"server": "nfs.lab", "path": "/export/data", "readOnly": True}},
        {
            "name": "reward-code",
            "configMap": {"name": "my-reward", "items": [{"key": "reward.py", "path": "reward.py"}]},
        },
        {"name": "scratch", "emptyDir": {"sizeLimit": "10Gi"}},
        {"name": "node-cache", "hostPath": {"path": "/var/cache/hf", "type": "DirectoryOrCreate"}},
        {"name": "certs", "secret": {"secretName": "ca", "defaultMode": 292}},
    ],
    "volumeMounts": [
        {"name": "models", "mountPath": "/models", "readOnly": True},
        {"name": "datasets", "mountPath": "/data", "subPath": "gsm8k"},
        {"name": "reward-code", "mountPath": "/rewards"},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "node-cache", "mountPath": "/root/.cache/huggingface"},
        {"name": "certs", "mountPath": "/etc/ssl/lab", "readOnly": True},
    ],
    "env": [
        {"name": "REWARD_API_TOKEN", "valueFrom": {"secretKeyRef": {"name": "reward-api", "key": "token"}}},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "DATA_VERSION", "valueFrom": {"configMapKeyRef": {"name": "data", "key": "version"}}},
    ],
    "envFrom": [{"secretRef": {"name": "wandb"}, "prefix": "WANDB_"}, {"configMapRef": {"name": "common"}}],
}


def _problems(**sections) -> list[tuple[str, str]]:
    _, problems = parse_spec(spec_dict(**sections))
    return [(p.path, p.message) for p in problems]


def test_inputs_in_the_usual_kuberay_shape_are_valid():
    assert _problems(**INPUTS) == []


def _with(section: str, index: int, entry: dict) -> dict:
    sections = {key: [dict(item) for item in value] for key, value in INPUTS.items()}
    sections[section][index] = entry
    return sections


@pytest.mark.parametrize(
    "sections, field, says",
    [
        # Names the operator uses itself.
        (
            {
                "volumes": [{"name": VOLUME_CHECKPOINTS, "emptyDir": {}}],
                "volumeMounts": [{"name": VOLUME_CHECKPOINTS, "mountPath": "/x"}],
            },
            "spec.volumes[0].name",
            "operator mounts",
        ),
        ({"env": [{"name": ENV_JOB_CONFIG, "value": "/tmp/other.yaml"}]}, "spec.env[0].name", "set by the operator"),
        ({"env": [{"name": ENV_RAY_AUTH_TOKEN, "value": "guess"}]}, "spec.env[0].name", "set by the operator"),
        # ... and the environment token, which it sets only in a job with environments.
        (
            {"env": [{"name": ENV_ENVIRONMENT_TOKEN, "value": "guess"}], "environments": [{"name": "e"}]},
            "spec.env[0].name",
            "of a job with spec.environments",
        ),
        # Mount paths the operator uses itself, the checkpoint's included (default /checkpoints).
        (
            _with("volumeMounts", 0, {"name": "models", "mountPath": "/etc/rldock"}),
            "spec.volumeMounts[0].mountPath",
            "job config",
        ),
        (
            _with("volumeMounts", 0, {"name": "models", "mountPath": "/checkpoints/models"}),
            "spec.volumeMounts[0].mountPath",
            "checkpoints",
        ),
        (
            _with("volumeMounts", 0, {"name": "models", "mountPath": "/dev"}),
            "spec.volumeMounts[0].mountPath",
            "shared memory",
        ),
        (
            _with("volumeMounts", 0, {"name": "models", "mountPath": "models"}),
            "spec.volumeMounts[0].mountPath",
            "absolute",
        ),
        (
            _with("volumeMounts", 1, {"name": "datasets", "mountPath": "/models/"}),
            "spec.volumeMounts[1].mountPath",
            "spec.volumeMounts[0]",
        ),
        (
            _with("volumeMounts", 1, {"name": "datasets", "mountPath": "/data", "subPath": "../etc"}),
            "spec.volumeMounts[1].subPath",
            "relative",
        ),
        # Mounts and volumes that do not meet.
        (
            _with("volumeMounts", 0, {"name": "model", "mountPath": "/models"}),
            "spec.volumeMounts[0].name",
            "no volume 'model'",
        ),
        (_with("volumeMounts", 0, {"name": "datasets", "mountPath": "/models"}), "spec.volumes[0]", "not mounted"),
        # Volumes: exactly one source, sane names and paths.
        (_with("volumes", 0, {"name": "models"}), "spec.volumes[0]", "exactly one source"),
        (
            _with("volumes", 0, {"name": "models", "emptyDir": {}, "persistentVolumeClaim": {"claimName": "x"}}),
            "spec.volumes[0]",
            "found persistentVolumeClaim, emptyDir",
        ),
        (_with("volumes", 0, {"name": "Models", "emptyDir": {}}), "spec.volumes[0].name", "DNS label"),
        (_with("volumes", 1, {"name": "models", "emptyDir": {}}), "spec.volumes[1].name", "earlier volume"),
        (
            _with("volumes", 1, {"name": "datasets", "nfs": {"server": "nfs", "path": "export"}}),
            "spec.volumes[1].nfs.path",
            "absolute",
        ),
        (
            _with("volumes", 4, {"name": "node-cache", "hostPath": {"path": "var/cache"}}),
            "spec.volumes[4].hostPath.path",
            "absolute",
        ),
        (
            _with(
                "volumes",
                2,
                {"name": "reward-code", "configMap": {"name": "r", "items": [{"key": "k", "path": "/abs"}]}},
            ),
            "spec.volumes[2].configMap.items[0].path",
            "relative",
        ),
        # Env: one value each, valid and unique names.
        (
            _with("env", 1, {"name": "HF_HUB_OFFLINE", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}),
            "spec.env[1]",
            "not both",
        ),
        (_with("env", 0, {"name": "TOKEN", "valueFrom": {}}), "spec.env[0].valueFrom", "exactly one"),
        (_with("env", 1, {"name": "1ST", "value": "x"}), "spec.env[1].name", "not a valid variable name"),
        (_with("env", 1, {"name": "REWARD_API_TOKEN", "value": "x"}), "spec.env[1].name", "spec.env[0]"),
        (_with("envFrom", 0, {"prefix": "X_"}), "spec.envFrom[0]", "exactly one of secretRef or configMapRef"),
        (_with("envFrom", 0, {"secretRef": {"name": "s"}, "prefix": "9X"}), "spec.envFrom[0].prefix", "prefix"),
        # A typo is an unknown field, with its path (the API server refuses it first, by the CRD schema).
        (
            _with("volumes", 0, {"name": "models", "persistentVolumeClam": {"claimName": "x"}}),
            "spec.volumes[0].persistentVolumeClam",
            "unknown field",
        ),
    ],
)
def test_problems_name_the_field(sections, field, says):
    problems = _problems(**sections)
    assert any(path == field and says in message for path, message in problems), problems


def _groups(spec: RLJobSpec) -> tuple[dict, dict]:
    cluster = build_ray_cluster(job=JOB, spec=spec)
    (worker,) = cluster["spec"]["workerGroupSpecs"]
    return cluster["spec"]["headGroupSpec"]["template"], worker["template"]


def test_inputs_reach_the_head_and_every_worker_after_the_operators_own():
    spec = RLJobSpec.model_validate(spec_dict(**INPUTS))
    for template in _groups(spec):
        pod = template["spec"]
        (container,) = pod["containers"]
        assert pod["volumes"][-len(INPUTS["volumes"]) :] == INPUTS["volumes"]
        assert container["volumeMounts"][-len(INPUTS["volumeMounts"]) :] == INPUTS["volumeMounts"]
        assert container["env"][-len(INPUTS["env"]) :] == INPUTS["env"]
        assert container["envFrom"] == INPUTS["envFrom"]
        assert container["env"][0]["name"] == ENV_JOB_CONFIG  # the operator's own come first, untouched


def test_a_spec_without_inputs_adds_nothing():
    for template in _groups(RLJobSpec.model_validate(spec_dict())):
        (container,) = template["spec"]["containers"]
        assert "envFrom" not in container
        assert [v["name"] for v in template["spec"]["volumes"]] == ["job-config", "checkpoints", "dshm", "tmp"]


def test_pods_with_inputs_are_valid_pods_and_match_kuberays_crd():
    spec = RLJobSpec.model_validate(spec_dict(**INPUTS))
    for role, template in zip(("head", "worker"), _groups(spec), strict=True):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "spec": template["spec"],
            "metadata": {**template["metadata"], "name": role, "namespace": JOB.namespace},
        }
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
    assert error_paths(kuberay_raycluster_validator(), build_ray_cluster(job=JOB, spec=spec)) == []


def test_inputs_change_the_cluster_hash():
    """A changed mount is a different cluster: the operator replaces it between attempts."""
    plain = build_ray_cluster(job=JOB, spec=RLJobSpec.model_validate(spec_dict()))
    with_inputs = build_ray_cluster(job=JOB, spec=RLJobSpec.model_validate(spec_dict(**INPUTS)))
    assert plain["metadata"]["annotations"] != with_inputs["metadata"]["annotations"]


def test_the_example_is_valid_and_mounts_its_inputs():
    example = yaml.safe_load((REPO / "examples" / "rljob-volumes.yaml").read_text())
    spec, problems = parse_spec(example["spec"])
    assert problems == [] and spec is not None
    for template in _groups(spec):
        (container,) = template["spec"]["containers"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert mounts["/models"] == mounts["/data"] == "llm-store" and mounts["/rewards"] == "reward-code"
        assert spec.job.model.path.startswith("/models/")
        assert {
            "name": "REWARD_API_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "reward-api", "key": "token"}},
        } in container["env"]


def test_a_job_without_environments_may_set_the_environment_token_itself():
    """The operator sets RLDOCK_ENV_TOKEN only in a job with spec.environments; any other job may pass
    the token of a server it reaches elsewhere, and it reaches every Ray pod once."""
    env = [{"name": ENV_ENVIRONMENT_TOKEN, "valueFrom": {"secretKeyRef": {"name": "env-server", "key": "token"}}}]
    assert _problems(env=env) == []
    for template in _groups(RLJobSpec.model_validate(spec_dict(env=env))):
        (container,) = template["spec"]["containers"]
        assert [var for var in container["env"] if var["name"] == ENV_ENVIRONMENT_TOKEN] == env
