"""The user's own Python objects that a job config names: reward functions (rewards/function.py), tools
and environments (agent/builders.py), one loader for all.

A reference is `path/to/file.py:name` or `package.module:name`. A file is imported under a module name
of its own, made from its resolved path, so two files called `reward.py` do not collide and the same
file named twice is imported once; a module is imported from the Python path. Every error names the
config field the reference came from and says what to change.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Literal


class UserCodeError(ValueError):
    """A reference names nothing loadable; the message starts with the config field."""


def load_object(
    reference: str,
    *,
    field: str,
    kind: Literal["function", "class"],
    error: type[Exception] = UserCodeError,
) -> object:
    """The function or class that `reference` names. `field` is the config field that holds it (the
    start of every message); `error` the exception class raised, called with the message alone."""
    target, _, attr = reference.rpartition(":")
    if target.endswith(".py"):
        module = load_file(Path(target), field=field, error=error)
    else:
        module = load_module(target, field=field, error=error)
    found = getattr(module, attr, None)
    if found is None:
        names = sorted(name for name, value in vars(module).items() if not name.startswith("_") and _is(kind, value))
        plural = "classes" if kind == "class" else "functions"
        raise error(f"{field}: {target} has no attribute {attr!r}; its {plural}: {names}")
    if not _is(kind, found):
        raise error(f"{field}: {wrong_kind(reference, type(found).__name__, kind)}")
    return found


def wrong_kind(reference: str, type_name: str, kind: str) -> str:
    """The message for a reference whose object is a `type_name`, not a `kind` (to follow the field);
    `rldock validate` says the same of a name the file's source binds to a literal."""
    return f"{reference} is a {type_name}, not a {kind}"


def _is(kind: Literal["function", "class"], value: object) -> bool:
    return isinstance(value, type) if kind == "class" else callable(value)


def load_file(path: Path, *, field: str, error: type[Exception] = UserCodeError) -> ModuleType:
    """The Python file at `path`, imported once per process under a name made from its resolved path."""
    path = path.resolve()
    if not path.is_file():
        raise error(
            f"{field}: no file {path} (a relative path is relative to the working "
            "directory of `rldock train`; in an RLJob mount the file and give its absolute path)"
        )
    name = f"rldock_user_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # what the file defines (dataclasses, pickled objects) finds its module
    try:
        spec.loader.exec_module(module)
    except Exception as cause:  # broad on purpose: importing user code may raise anything
        del sys.modules[name]
        raise error(f"{field}: importing {path} failed: {type(cause).__name__}: {cause}") from cause
    return module


def load_module(name: str, *, field: str, error: type[Exception] = UserCodeError) -> ModuleType:
    """The module `name`, imported from the Python path."""
    try:
        return importlib.import_module(name)
    except Exception as cause:  # broad on purpose: importing user code may raise anything
        raise error(
            f"{field}: cannot import module {name!r}: {type(cause).__name__}: {cause} "
            "(is it installed, or on PYTHONPATH?)"
        ) from cause
