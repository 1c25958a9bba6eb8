"""The harness's pure parts, without a control plane: KubeRay CRD edits and emulated-node objects."""

from __future__ import annotations

import pytest

from e2e.controlplane.crds import KUBERAY_CRD_DIR, downgrade_for_1_20, kuberay_crd_files, load_documents
from e2e.controlplane.nodes import ASCEND_NODE_LABELS, node_manifest, node_status


def _walk(node):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


LIST_MAP = {
    "type": "array",
    "x-kubernetes-list-type": "map",
    "x-kubernetes-list-map-keys": ["containerPort", "protocol"],
    "items": {"type": "object", "required": ["containerPort"], "properties": {
        "containerPort": {"type": "integer"},
        "protocol": {"type": "string", "default": "TCP"},
        "name": {"type": "string"},
    }},
}


@pytest.mark.parametrize("schema, expected", [
    ({"type": "string", "x-kubernetes-validations": [{"rule": "self == oldSelf"}]},
     {"type": "string"}),
    ({"type": "string", "default": ""}, {"type": "string"}),
    ({"type": "string", "default": "x"}, {"type": "string", "default": "x"}),
    (LIST_MAP, LIST_MAP),  # the key without a default is already required: unchanged
    ({**LIST_MAP, "x-kubernetes-list-map-keys": ["name"]},
     {**LIST_MAP, "x-kubernetes-list-map-keys": ["name"],
      "items": {**LIST_MAP["items"], "required": ["containerPort", "name"]}}),
], ids=["cel", "empty-default", "real-default", "keys-required", "key-made-required"])
def test_downgrade_for_1_20(schema: dict, expected: dict) -> None:
    crd = {"spec": {"versions": [{"schema": {"openAPIV3Schema": schema}}]}}
    out = downgrade_for_1_20(crd)
    assert out["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == expected
    assert crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"] == schema  # input untouched


def test_downgrade_of_kuberay_crds_leaves_nothing_1_20_refuses() -> None:
    if not KUBERAY_CRD_DIR.is_dir():
        pytest.skip(f"KubeRay's CRDs are read from {KUBERAY_CRD_DIR}, which is absent here")
    for path in kuberay_crd_files():
        for doc in load_documents(path):
            nodes = list(_walk(downgrade_for_1_20(doc)))
            assert not any("x-kubernetes-validations" in n for n in nodes), path
            assert not any(n.get("default") == "" for n in nodes), path
            for n in nodes:
                for key in n.get("x-kubernetes-list-map-keys", []):
                    item = n["items"]
                    assert key in item.get("required", []) or "default" in item["properties"][key]


def test_emulated_node_objects() -> None:
    manifest = node_manifest("npu-3", labels={"pool": "a"})
    assert manifest["metadata"]["labels"] == {
        "kubernetes.io/hostname": "npu-3", "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64", **ASCEND_NODE_LABELS, "pool": "a"}
    status = node_status("npu-3", device_resource="huawei.com/Ascend910", num_devices=16)
    assert status["capacity"] == status["allocatable"]
    assert status["allocatable"]["huawei.com/Ascend910"] == "16"
    assert [c["type"] for c in status["conditions"]] == ["Ready"]
    cpu_only = node_status("cpu-0", device_resource=None)
    assert not any("/" in key for key in cpu_only["allocatable"])
