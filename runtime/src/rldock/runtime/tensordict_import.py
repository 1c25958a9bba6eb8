"""tensordict without torch's compiler stack: ~1.5 s of CPU less in every process that uses the dock.

At import tensordict marks a few of its functions for torch.compile (`torch.compiler.allow_in_graph`,
`assume_constant_result`), and each mark imports `torch._dynamo` and with it most of the compiler:
1.85 s of CPU for `import tensordict` after torch, 0.31 s without (fresh interpreter, the 2-core
machine). rldock compiles none of tensordict's code, so the marks buy nothing here: while
tensordict's modules execute, those two decorators return the function unchanged.

`install()` (run by `rldock.runtime`'s package import, before any of its modules can import
tensordict) puts a finder on sys.meta_path that does this for the first import of tensordict and
then steps aside. A process that imported tensordict, or torch._dynamo, before gets it unchanged: the
compiler stack is loaded already. The cost of the shortcut: code compiled with torch.compile that
calls tensordict traces into those functions instead of keeping them whole (vLLM compiles only its
own model code).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

_PACKAGE = "tensordict"


@contextmanager
def compiler_marks_unchanged() -> Iterator[None]:
    """While inside: torch.compiler's allow_in_graph and assume_constant_result return their argument
    (the module docstring). Nothing changes once torch._dynamo is loaded: its cost is paid."""
    import torch.compiler

    if "torch._dynamo" in sys.modules:
        yield
        return
    compiler: Any = torch.compiler
    saved = compiler.allow_in_graph, compiler.assume_constant_result
    compiler.allow_in_graph = compiler.assume_constant_result = _unchanged
    try:
        yield
    finally:
        compiler.allow_in_graph, compiler.assume_constant_result = saved


def _unchanged(fn: Any) -> Any:
    return fn


class _Loader(importlib.abc.Loader):
    """tensordict's own loader, its package body run inside compiler_marks_unchanged (its submodules,
    imported by that body, with it)."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        with compiler_marks_unchanged():
            self._loader.exec_module(module)

    def __getattr__(self, name: str) -> Any:  # resources and source, as the real loader has them
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _PACKAGE:
            return None
        uninstall()  # once: the real finders from here on
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Import tensordict, when something first does, without the compiler stack (module docstring)."""
    if _PACKAGE in sys.modules or any(isinstance(finder, _Finder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


def uninstall() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _Finder)]
