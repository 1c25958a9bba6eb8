"""`function`: the user's own reward function, loaded in the reward worker's process.

`reward.terms[i].function` names it as `path/to/file.py:name` (the file is imported under a
module name of its own, so two files called `reward.py` do not collide) or `package.module:name`
(imported from the Python path). It must have the signature
`fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from rldock.config.job import RewardTermSpec
from rldock.runtime.rewards.base import BatchRewardFn, RewardError, per_sample, register_reward


def _load_file(path: Path, at: str) -> ModuleType:
    path = path.expanduser().resolve()
    if not path.is_file():
        raise RewardError(
            f"{at}.function: no file {path} (a relative path is relative to the working "
            "directory of `rldock train`; in an RLJob mount the file and give its absolute path)"
        )
    name = f"rldock_user_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # what the file defines (dataclasses, pickled objects) finds its module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # broad on purpose: importing user code may raise anything
        del sys.modules[name]
        raise RewardError(f"{at}.function: importing {path} failed: {type(error).__name__}: {error}") from error
    return module


def _load_module(name: str, at: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as error:  # broad on purpose: importing user code may raise anything
        raise RewardError(
            f"{at}.function: cannot import module {name!r}: {type(error).__name__}: {error} "
            "(is it installed, or on PYTHONPATH?)"
        ) from error


def load_function(reference: str, at: str) -> Callable:
    """The callable named by `file.py:name` or `module:name`; RewardError naming `at` if there is none."""
    target, _, attr = reference.rpartition(":")
    module = _load_file(Path(target), at) if target.endswith(".py") else _load_module(target, at)
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise RewardError(f"{at}.function: {target} has no attribute {attr!r}; its functions: {public}")
    if not callable(fn):
        raise RewardError(f"{at}.function: {reference} is a {type(fn).__name__}, not a function")
    return fn


@register_reward("function")
def _build_function(term: RewardTermSpec, at: str) -> BatchRewardFn:
    assert term.function is not None  # problems.py requires it for a `function` term
    return per_sample(load_function(term.function, at))
