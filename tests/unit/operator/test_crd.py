"""The generated RLJob CRD: checked in and current, structural, acceptable to old API servers, and
really validating (a bad spec is refused by the schema, as by the models)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from rljob_testing import DELETE, KUBERNETES_VERSION, error_paths, set_path, spec_dict, validator_for

from rldock.operator.api import RLJobSpec
from rldock.operator.crd import build_crd, openapi_schema, render, rljob_schema, structural_errors
from rldock.operator.validation import parse_spec

CRD_FILE = Path(__file__).resolve().parents[3] / "crds" / "rljobs.rldock.io.yaml"


def _nodes(schema: Any, path: str = "") -> Iterator[tuple[str, dict]]:
    if isinstance(schema, dict):
        yield path, schema
        for key, value in schema.items():
            yield from _nodes(value, f"{path}.{key}")
    elif isinstance(schema, list):
        for index, value in enumerate(schema):
            yield from _nodes(value, f"{path}[{index}]")


def test_checked_in_crd_is_current():
    assert CRD_FILE.read_text() == render(), (
        "crds/rljobs.rldock.io.yaml is stale: python -m rldock.operator.crd > crds/rljobs.rldock.io.yaml"
    )


def test_crd_is_a_valid_customresourcedefinition():
    kubernetes_validate.validate(yaml.safe_load(render()), KUBERNETES_VERSION, strict=True)


def test_crd_names_subresources_and_columns():
    spec = build_crd()["spec"]
    assert build_crd()["metadata"]["name"] == "rljobs.rldock.io"
    assert spec["names"]["shortNames"] == ["rlj"] and spec["names"]["kind"] == "RLJob"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["subresources"] == {"status": {}}
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert list(columns)[:4] == ["Phase", "Iteration", "Reward", "TPS"] and "Age" in columns
    root = version["schema"]["openAPIV3Schema"]
    for column in columns.values():  # every column points at a field that exists
        section, *fields = column["jsonPath"].split(".")[1:]
        if section == "status":
            node = root["properties"]["status"]
            for field in fields:
                assert field in node.get("properties", {}), column
                node = node["properties"][field]
            assert node["type"] == column["type"] or (node["type"], column["type"]) == ("string", "date"), column
        else:
            assert column["jsonPath"] == ".metadata.creationTimestamp"


def test_wide_columns_show_the_last_evaluation():
    """`kubectl get rljobs -o wide` (priority 1) shows the held-out reward and accuracy."""
    (version,) = build_crd()["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert columns["Val-Reward"]["jsonPath"] == ".status.lastEvaluation.reward"
    assert columns["Val-Acc"]["jsonPath"] == ".status.lastEvaluation.accuracy"
    assert columns["Val-Reward"]["priority"] == columns["Val-Acc"]["priority"] == 1
    assert all(columns[name].get("priority", 0) == 0 for name in ("Phase", "Iteration", "Reward", "TPS"))


def test_schema_is_structural_and_fits_kubernetes_1_20():
    schema = rljob_schema()
    assert structural_errors(schema) == []
    for path, node in _nodes(schema):
        assert "$ref" not in node and "const" not in node and "$defs" not in node, path
        assert "x-kubernetes-validations" not in node, f"{path}: CEL needs Kubernetes 1.25"
        assert "default" not in node, f"{path}: defaults stay in the models"
        assert "nullable" not in node, f"{path}: optional means not required (a null is pruned)"


@pytest.mark.parametrize(
    "bad, complaint",
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/x"}}}, "no type"),
        ({"type": "object", "properties": {"a": {"type": "string", "const": "x"}}}, "'const'"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}, "both"),
        ({"type": "integer", "minimum": 0, "exclusiveMinimum": 0}, "boolean"),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "anyOf other than int-or-string"),
        ({"type": "object", "required": ["b"], "properties": {"a": {"type": "string"}}}, "'b' is not a property"),
        ({"type": "string", "x-kubernetes-validations": [{"rule": "self != ''"}]}, "x-kubernetes-validations"),
    ],
)
def test_structural_errors_catch_what_the_api_server_refuses(bad, complaint):
    assert any(complaint in error for error in structural_errors(bad)), structural_errors(bad)


def test_embedded_job_config_keeps_its_snake_case_and_required_fields():
    job = openapi_schema(RLJobSpec)["properties"]["job"]
    assert set(job["required"]) == {"iterations", "model", "algorithm"}
    assert "num_prompts_per_iteration" in job["properties"]["algorithm"]["properties"]
    spec = openapi_schema(RLJobSpec)["properties"]
    assert {"backoffLimit", "ttlSecondsAfterFinished", "suspend", "checkpoint"} <= set(spec)
    assert "num_nodes" in job["properties"]["resources"]["properties"]
    assert "numNodes" not in str(spec["cluster"]), "the cluster shape lives in job.resources only"


def _spec_validator():
    return validator_for(rljob_schema()["properties"]["spec"])


@pytest.mark.parametrize(
    "path, value",
    [
        ("ttlSecondsAfterFinished", 0),
        ("scheduling", {"gang": "kueue", "queue": "team-a"}),
        (
            "cluster",
            {
                "head": {"cpu": 4, "memory": "16Gi"},
                "worker": {"cpu": "500m", "memory": 1073741824},
                "nodeSelector": {"node.kubernetes.io/instance-type": "ascend-910b"},
                "tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}],
            },
        ),
        ("ttlSecondsAfterFinished", 3600),
        ("job.algorithm.clip_ratio", 0.1),
        ("image", "localhost:5000/team/rldock-runtime:dev"),
        ("image", "ghcr.io/rldock/rldock-runtime@sha256:" + "0" * 64),
        ("image", "rldock"),
        ("job.model.path", "/m" * 2048),
    ],
)
def test_schema_accepts_valid_specs(path, value):
    spec = set_path(spec_dict(), path, value)
    assert error_paths(_spec_validator(), spec) == []
    assert parse_spec(spec)[0] is not None


@pytest.mark.parametrize(
    "path, value, error_at",
    [
        ("backoffLimit", "three", "backoffLimit"),  # wrong type
        ("suspend", "maybe", "suspend"),
        ("scheduling.gang", "slurm", "scheduling.gang"),  # not in the enum
        ("job.dock.mode", "sharded", "job.dock.mode"),  # the job's Literal
        ("job.iterations", 0, "job.iterations"),  # below minimum
        ("backoffLimit", -1, "backoffLimit"),
        ("job.algorithm.clip_ratio", 0, "job.algorithm.clip_ratio"),  # exclusive minimum
        ("job.rollout.top_p", 1.5, "job.rollout.top_p"),  # above maximum
        ("job.algorithm", DELETE, "job"),  # required field missing
        ("checkpoint", DELETE, ""),
        ("cluster.head", {"cpu": 4}, "cluster.head"),
        ("cluster.gpus", 8, "cluster"),  # unknown field
        ("job.algorithm.lr", 0.1, "job.algorithm"),
        ("job.resources.numNodes", 2, "job.resources"),  # camelCase is not the job's spelling
        ("cluster.worker.memory", "lots", "cluster.worker.memory"),  # not a quantity
        ("cluster.worker.cpu", 1.5, "cluster.worker.cpu"),  # fractions must be quoted
        ("cluster.nodeSelector", {"zone": 1}, "cluster.nodeSelector.zone"),
        ("cluster.tolerations", [{"effect": "Sometimes"}], "cluster.tolerations.0.effect"),
        ("image", "", "image"),
        # Accepted before, then hung or failed with union noise (issue 18):
        ("image", "ghcr.io/rldock/runtime:1 0", "image"),  # a space
        ("image", "my image", "image"),
        ("image", "x" * 513, "image"),
        ("cluster.worker", {"cpu": -4, "memory": "8Gi"}, "cluster.worker.cpu"),  # negative
        ("cluster.worker", {"cpu": "-500m", "memory": "8Gi"}, "cluster.worker.cpu"),
        ("job.model.path", "/m" * 2049, "job.model.path"),  # beyond PATH_MAX
        ("checkpoint", {"claimName": "c" * 254}, "checkpoint.claimName"),
        ("cluster.nodeSelector", {"zone": "z" * 64}, "cluster.nodeSelector.zone"),
        ("scheduling", {"gang": "kueue", "queue": "q" * 254}, "scheduling.queue"),
        ("job.agent", {"tools": [{"name": "t.py:T", "options": {"k": 1}}]}, "job.agent.tools.0.options.k"),
        (
            "job.agent",
            {"tools": [{"name": "t.py:T", "options": {str(k): "" for k in range(65)}}]},
            "job.agent.tools.0.options",
        ),
    ],
)
def test_schema_refuses_bad_specs_like_the_models_do(path, value, error_at):
    spec = set_path(spec_dict(), path, value)
    assert error_at in error_paths(_spec_validator(), spec)
    parsed, problems = parse_spec(spec)
    assert parsed is None and problems, "the models must refuse what the schema refuses"


def test_the_schema_takes_an_agent_with_string_options():
    agent = {
        "tools": [{"name": "t.py:T", "options": {str(k): "v" for k in range(64)}}],
        "environment": {"name": "feedback"},
    }
    assert error_paths(_spec_validator(), set_path(spec_dict(), "job.agent", agent)) == []


def test_every_field_is_described():
    """`kubectl explain rljob.spec...` shows these. The job config's sections are the exception:
    their fields are described, the sections themselves in docs/config-reference.md."""
    spec = rljob_schema()["properties"]["spec"]
    undocumented = [
        path
        for path, node in _nodes(spec, ".spec")
        if path.rsplit(".", 2)[-2] == "properties"
        and "description" not in node
        and not (path.startswith(".spec.properties.job.") and node["type"] == "object")
    ]
    assert undocumented == []
