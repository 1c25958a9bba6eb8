"""The RLJob examples a new user applies first (examples/rljob-*.yaml) pass what the cluster checks
before anything runs: the CRD's schema (checked in, as the API server serves it) and the
operator's spec validation; the CPU-only one builds a Ray cluster that asks for no device.
`rldock validate` of each example's job config is tests/unit/runtime/test_examples.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from rljob_testing import error_paths, validator_for

from rldock.operator.api import PodDefaults
from rldock.operator.builders import RLJobRef, build_ray_cluster
from rldock.operator.constants import DEFAULT_CHECKPOINT_MOUNT_PATH
from rldock.operator.validation import parse_spec

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = sorted((REPO / "examples").glob("rljob-*.yaml"))
CPU_EXAMPLE = REPO / "examples" / "rljob-cpu.yaml"
CRD = REPO / "crds" / "rljobs.rldock.io.yaml"


def _manifest(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_walk_finds_the_rljob_examples():
    assert {"rljob-tiny.yaml", "rljob-cpu.yaml", "rljob-volumes.yaml"} <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda path: path.name)
def test_each_rljob_example_passes_the_crd_schema_and_the_operators_validation(path):
    manifest = _manifest(path)
    assert (manifest["apiVersion"], manifest["kind"]) == ("rldock.io/v1alpha1", "RLJob")
    (version,) = yaml.safe_load(CRD.read_text())["spec"]["versions"]
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert error_paths(validator_for(spec_schema), manifest["spec"]) == []
    spec, problems = parse_spec(manifest["spec"])
    assert spec is not None and problems == [], problems


@pytest.mark.parametrize("defaults", [PodDefaults(), PodDefaults(device_resource="nvidia.com/gpu")])
def test_the_cpu_example_asks_for_no_device_and_small_pods(defaults):
    """On any installation (the Ascend default, a GPU one): only CPU and memory, 5 CPUs and 12Gi in
    all, the claim the docs create, and Ray's emulated device slot on the worker."""
    manifest = _manifest(CPU_EXAMPLE)
    spec, _ = parse_spec(manifest["spec"])
    assert spec is not None and spec.job.resources.device == "cpu"
    job = RLJobRef(name=manifest["metadata"]["name"], namespace="team-a", uid="0f5c2a6e-1111-2222-3333-444455556666")
    cluster = build_ray_cluster(job=job, spec=spec, defaults=defaults)
    (worker,) = cluster["spec"]["workerGroupSpecs"]
    limits = [
        group["template"]["spec"]["containers"][0]["resources"]["limits"]
        for group in (cluster["spec"]["headGroupSpec"], worker)
    ]
    assert limits == [{"cpu": "1", "memory": "4Gi"}, {"cpu": "4", "memory": "8Gi"}]
    assert worker["rayStartParams"] == {"resources": """'{"NPU": 1}'"""}
    assert spec.checkpoint.claim_name == "rl-checkpoints"
    assert spec.checkpoint.mount_path == DEFAULT_CHECKPOINT_MOUNT_PATH
    assert spec.job.model.path.startswith(DEFAULT_CHECKPOINT_MOUNT_PATH)  # built on the claim, nothing downloaded
