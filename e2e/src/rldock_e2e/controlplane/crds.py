"""Make KubeRay's CRDs acceptable to a 1.20 apiserver without loosening what they validate.

KubeRay generates its CRDs for current Kubernetes. A 1.20 apiserver refuses three things in them
(see ../shared/notes/control-plane.md); `downgrade_for_1_20` removes exactly those and nothing
else, so every RayCluster is still checked against KubeRay's real structural schema.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from rldock_e2e.repo import kuberay_crd_dir

KUBERAY_CRD_DIR = kuberay_crd_dir()


def _schemas(node: Any) -> Iterator[dict]:
    """Every dict in a CRD document (all schema nodes among them), depth first."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _schemas(value)
    elif isinstance(node, list):
        for value in node:
            yield from _schemas(value)


def downgrade_for_1_20(crd: dict) -> dict:
    """A copy of `crd` with the three 1.20 incompatibilities removed:

    - `x-kubernetes-validations` (CEL rules, 1.25+) are dropped;
    - `default: ""` is dropped (1.20 reads an empty-string default as null and refuses it);
    - for arrays with `x-kubernetes-list-map-keys`, a key property with no default is added to the
      item's `required` (1.20 insists that map keys are required or defaulted).
    """
    crd = copy.deepcopy(crd)
    for node in list(_schemas(crd)):
        node.pop("x-kubernetes-validations", None)
        if node.get("default") == "":
            del node["default"]
    for node in _schemas(crd):
        keys = node.get("x-kubernetes-list-map-keys")
        if not keys:
            continue
        items = node.get("items", {})
        properties = items.get("properties", {})
        required = items.setdefault("required", [])
        for key in keys:
            if key not in required and "default" not in properties.get(key, {}):
                required.append(key)
    return crd


# libyaml's loader and dumper are ~10x faster on KubeRay's 1-2 MB CRDs.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def load_documents(path: Path) -> list[dict]:
    with open(path) as f:
        return [doc for doc in yaml.load_all(f, Loader=_Loader) if doc]


def dump_documents(docs: list[dict]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def kuberay_crd_files(directory: Path = KUBERAY_CRD_DIR) -> list[Path]:
    files = sorted(directory.glob("*.yaml"))
    if not files:
        raise FileNotFoundError(f"no KubeRay CRDs (*.yaml) in {directory}")
    return files
