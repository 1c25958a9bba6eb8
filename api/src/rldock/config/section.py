"""The base of every config section and the field vocabulary the sections share (rldock.config.job
composes the sections into JobConfig; a section with a module of its own, such as
rldock.config.agent_environment, builds on the same base): string bounds, the marker of fields naming files
(`Expanded`), a user's options, and the check of a built-in name or a user's class reference."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from pydantic import BaseModel, ConfigDict, StringConstraints


class Spec(BaseModel):
    """Base of every config section: unknown fields are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# Bounds of the free strings (also in the RLJob's CRD schema, which embeds this model): long enough
# for any real value, short enough that a job config always fits a ConfigMap (1 MiB).
MAX_PATH_LENGTH = 4096  # PATH_MAX on Linux
MAX_NAME_LENGTH = 253  # a DNS subdomain, the longest Kubernetes name
DataFile = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH_LENGTH)]


@dataclass(frozen=True)
class Expanded:
    """Marks a field that names files on the machine the job runs on (in an annotation's metadata):
    `~` at its start is expanded, and with `variables` also `$NAME` and `${NAME}` anywhere in it, once,
    where the config is loaded to run (config/paths.py). Never in the operator, whose home and
    environment are not the pods'. A list field's marker applies to each item."""

    variables: bool


# A path or a `file.py:name` reference: `~` and `$VARS`. A command's arguments: `~` only, as a shell
# would expand a word's start; `$` stays for the program (a `sh -c` script reads its own variables).
PATH = Expanded(variables=True)
COMMAND = Expanded(variables=False)


# A user's class, named `path/to/file.py:Class` or `package.module:Class` like a reward function, with
# its options (keyword arguments, strings).
_CLASS_REFERENCE = re.compile(r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")
UserOptions = dict[
    Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_LENGTH)],
    Annotated[str, StringConstraints(max_length=MAX_PATH_LENGTH)],
]


def check_class_name(name: str, builtins: tuple[str, ...], kind: str) -> str:
    """`name` if it is one of `builtins` or a class reference; else a ValueError naming both forms."""
    if name in builtins or _CLASS_REFERENCE.match(name):
        return name
    raise ValueError(
        f"{name!r} is not a built-in {kind} ({', '.join(builtins)}) nor a class of your own "
        f"written `path/to/file.py:Class` or `package.module:Class`"
    )


def bare_off(value: object) -> object:
    # YAML 1.1 (PyYAML, kubectl) reads a bare `off` as false: in a mode field that lists `off`, it means the mode.
    return "off" if value is False else value
