"""The operator's image has no torch, Ray or vLLM: its modules must import without them."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import rldock.config
import rldock.contract
import rldock.operator

HEAVY = ("torch", "ray", "vllm", "transformers")
# The pure layers do no I/O, so they need no Kubernetes client either.
PURE = (
    "actions",
    "api",
    "builders",
    "constants",
    "crd",
    "naming",
    "observe",
    "rayjobs",
    "rules",
    "settings",
    "status",
    "validation",
)


def _modules() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.walk_packages(rldock.operator.__path__, "rldock.operator.")
        if not m.name.endswith("__main__")
    )


def _ground_floor() -> list[str]:
    return sorted(
        m.name
        for package in (rldock.config, rldock.contract)
        for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
    )


# Makes the heavy packages unimportable, as in the operator image where they are not installed.
_BLOCK_HEAVY = f"""
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {HEAVY!r}:
            raise ImportError(f'{{name}} is not installed in the operator image')
sys.meta_path.insert(0, _Absent())
"""


def _imported_after(modules: list[str]) -> set[str]:
    code = (
        _BLOCK_HEAVY + "import importlib\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    # A fresh interpreter: this test session may already hold torch from other tests.
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_operator_imports_without_the_runtime_stack():
    """Every operator module, the job API and the contract import with torch, Ray, vLLM and
    transformers unimportable (what the operator image installs: rldock[operator])."""
    modules = _modules() + _ground_floor()
    assert "rldock.operator.status" in modules and "rldock.contract.progress" in modules
    assert _imported_after(modules).isdisjoint(HEAVY)


def test_heavy_packages_are_really_blocked():
    with pytest.raises(subprocess.CalledProcessError, match="returned non-zero"):
        _imported_after(["rldock.runtime.driver.trainer"])


def test_pure_layers_need_no_kubernetes_client():
    modules = [m for m in _modules() if m.split(".")[2] in PURE]
    assert _imported_after(modules).isdisjoint({*HEAVY, "kopf", "kubernetes"})
