"""The operator's image has no torch, Ray or vLLM: its modules must import without them."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import rldock.operator

HEAVY = ("torch", "ray", "vllm", "transformers")
# The pure layers do no I/O, so they need no Kubernetes client either.
PURE = ("api", "builders", "constants", "crd", "naming", "observe", "plan", "rayjobs", "settings", "status",
        "validation")


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(rldock.operator.__path__, "rldock.operator."))


def _imported_after(modules: list[str]) -> set[str]:
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print('\\n'.join(sorted({m.split('.')[0] for m in sys.modules})))")
    # A fresh interpreter: this test session may already hold torch from other tests.
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_operator_never_imports_the_runtime_stack():
    modules = _modules()
    assert "rldock.operator.status" in modules
    assert _imported_after(modules).isdisjoint(HEAVY)


def test_pure_layers_need_no_kubernetes_client():
    modules = [m for m in _modules() if m.split(".")[2] in PURE]
    assert _imported_after(modules).isdisjoint({*HEAVY, "kopf", "kubernetes"})
