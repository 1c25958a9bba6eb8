"""Preflight: every path a job config names exists and is readable, checked before Ray starts.

In an RLJob the paths point into volumes the pods mount (spec.volumes/volumeMounts); a path that
is not there fails the job within seconds, naming the field and the path, instead of minutes later
inside a Ray worker with a traceback. `rldock train` and `rldock validate` run these checks; the
failure line (rldock.contract.failure) carries them to the RLJob's status.

The checks are a table, one row per configured path: the field, a getter, and what must be there.
A field that holds a list is one row whose field has `{i}` and whose getter returns the list
(None entries are skipped, so a getter can keep the indexes of a list it filters).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from rldock.config import JobConfig, Problem, find_local_problems
from rldock.config.problems import model_config_problem
from rldock.contract.failure import FailureReason, FieldProblem, JobFailure
from rldock.runtime.agent.service.env_probe import environment_server_problems
from rldock.runtime.chat.harness_request import FIELD as HARNESS_REQUEST
from rldock.runtime.chat.harness_request import FIX as HARNESS_REQUEST_FIX
from rldock.runtime.chat.harness_request import HarnessRequestError, read_harness_request
from rldock.runtime.data.probe import data_file_problems
from rldock.runtime.data.prompt_lengths import prompt_set_problems
from rldock.runtime.driver.tracking import wandb_credentials_problems
from rldock.runtime.gateway.harness_runner import load_harness
from rldock.runtime.sandbox.runner import sandbox_layer_problems
from rldock.runtime.user_code import wrong_kind
from rldock.runtime.workers.ray_devices import local_device_problems

MOUNT_HINT = "mount the volume that holds it (RLJob spec.volumes/volumeMounts) or fix the path"
OUTPUT_FIELD = "--output"
_LISTED = 5  # entries of a directory named in a message


class PathKind(Enum):
    FILE = "file"  # a readable file
    DIR = "dir"  # a readable, searchable directory
    MODEL_DIR = "model-dir"  # a Hugging Face format directory: config.json inside


Paths = str | None | Sequence[str | None]


@dataclass(frozen=True)
class PathCheck:
    field: str  # the field path; `{i}` is replaced by the index for list fields
    paths: Callable[[JobConfig], Paths]
    kind: PathKind
    missing: str = MOUNT_HINT  # what to do when the path does not exist


CHECKS: tuple[PathCheck, ...] = (
    # A model the runtime builds itself (tiny demo models) need not exist yet.
    PathCheck("model.path", lambda cfg: None if cfg.model.builder is not None else cfg.model.path, PathKind.MODEL_DIR),
    # Data files (a generator writes its own into the output, so a generator's section lists none).
    PathCheck("data.train_files[{i}]", lambda cfg: cfg.data.train_files, PathKind.FILE),
    PathCheck("data.val_files[{i}]", lambda cfg: cfg.data.val_files, PathKind.FILE),
    # A user reward function given as a file (`rewards/my.py:score`); a module reference is imported.
    PathCheck(
        "reward.terms[{i}].function",
        lambda cfg: [function_file(term.function) for term in cfg.reward.terms],
        PathKind.FILE,
    ),
    # The user's own tool and environment classes given as files (`tools/search.py:Search`); a built-in
    # name or a module reference is no path.
    PathCheck(
        "agent.tools[{i}].name",
        lambda cfg: [function_file(tool.name) for tool in cfg.agent.tools] if cfg.agent is not None else [],
        PathKind.FILE,
    ),
    PathCheck(
        "agent.environment.name",
        lambda cfg: (
            function_file(cfg.agent.environment.name)
            if cfg.agent is not None and cfg.agent.environment is not None
            else None
        ),
        PathKind.FILE,
    ),
    # The user's harness given as a file (`agents/mine.py:run`), or the files its command names.
    PathCheck(
        "agent.harness",
        lambda cfg: function_file(cfg.agent.harness) if cfg.agent is not None else None,
        PathKind.FILE,
    ),
    PathCheck(
        "agent.harness_command[{i}]",
        lambda cfg: command_files(cfg.agent.harness_command) if cfg.agent is not None else [],
        PathKind.FILE,
    ),
    # A harness's captured first request, which the job's prompts are rendered with (`rldock agent capture`).
    PathCheck(
        "agent.harness_request",
        lambda cfg: cfg.agent.harness_request if cfg.agent is not None else None,
        PathKind.FILE,
        missing=f"{HARNESS_REQUEST_FIX}, or {MOUNT_HINT}",
    ),
    # A `model` term's reward model folder (config.json, tokenizer, weights).
    PathCheck("reward.terms[{i}].path", lambda cfg: [term.path for term in cfg.reward.terms], PathKind.MODEL_DIR),
)


def function_file(reference: str | None) -> str | None:
    """The file part of a reference to a user function or class, or None when it names a module (or
    is a built-in's name).

    `rewards/my.py:score` -> `rewards/my.py`; `my_pkg.rewards:score` -> None (imported, not a path).
    For the table rows of `function` reward terms and of the agent's own tools and environment.
    """
    if not reference:
        return None
    target = reference.rpartition(":")[0] or reference
    return target if target.endswith(".py") or "/" in target else None


# The interpreters whose first argument that is no option is the script they run: for each, the option
# letters that take a value (attached, or the next argument) and those after which the program is no file
# (`-c code`, `-m module`, `-s`: standard input), and the long options that take the next argument.
_PYTHON = (frozenset("WX"), frozenset("cm"), frozenset({"--check-hash-based-pycs"}))
_SHELL = (frozenset("oO"), frozenset("cs"), frozenset({"--rcfile", "--init-file"}))
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})


def command_files(command: Sequence[str] | None) -> list[str | None]:
    """The files a harness command names, at their places in it (None at the others): its program where it is
    a path (`./agent.sh`, `/venv/bin/python`; a bare name is looked up on PATH, harness_problems), and the
    script of python or a shell (`python -u agent.py`, `bash -e run.sh`; none for `python -m mod` or `sh -c
    ...`). The runner gives the command no working directory of its own, so a relative path is relative to
    the actor's, which is `rldock train`'s: here, this process's."""
    if not command:
        return []
    files: list[str | None] = [command[0] if "/" in command[0] else None] + [None] * (len(command) - 1)
    program = os.path.basename(command[0])
    python = re.fullmatch(r"(python|pypy)\d*(\.\d+)?", program) is not None
    if not python and program not in _SHELLS:
        return files
    takes_value, no_file, long_with_value = _PYTHON if python else _SHELL
    index = 1
    while index < len(command):
        word = command[index]
        if word == "--":
            index += 1
            break
        if word == "-" or not word.startswith(("-", "+")) or (python and word.startswith("+")):
            break
        if word.startswith("--"):
            index += 2 if word in long_with_value else 1
            continue
        for position, letter in enumerate(word[1:], start=1):
            if letter in no_file:
                return files
            if letter in takes_value:
                index += position == len(word) - 1  # its value is the next argument
                break
        index += 1
    if index < len(command) and command[index] != "-":
        files[index] = command[index]
    return files


def find_path_problems(cfg: JobConfig, *, checks: Sequence[PathCheck] = CHECKS) -> list[Problem]:
    """Problems of every configured path, in table order."""
    problems = []
    for check in checks:
        value = check.paths(cfg)
        named = (
            [(check.field, value)]
            if value is None or isinstance(value, str)
            else [(check.field.format(i=index), path) for index, path in enumerate(value)]
        )
        for field, path in named:
            if path is not None:
                message = path_problem(Path(path), check.kind, missing=check.missing)
                if message is not None:
                    problems.append(Problem(field, f"{path} {message}"))
    return problems


def path_problem(path: Path, kind: PathKind, *, missing: str = MOUNT_HINT) -> str | None:
    """What is wrong with `path` for `kind` (to follow the path in a message), or None; `missing` is the fix
    of a path that does not exist."""
    if not path.exists():
        return f"does not exist (nearest existing folder: {_nearest_existing(path)}); {missing}"
    want_dir = kind is not PathKind.FILE
    if want_dir and not path.is_dir():
        return "is not a directory"
    if not want_dir and not path.is_file():
        return "is not a file"
    if not os.access(path, os.R_OK | (os.X_OK if want_dir else 0)):
        return f"is not readable by this process (uid {os.getuid()}); check the volume's permissions"
    if kind is PathKind.MODEL_DIR and not (path / "config.json").is_file():
        return (
            f"has no config.json, so it is not a Hugging Face format model directory "
            f"(it holds: {_listing(path)}); point it at the folder with config.json, tokenizer and weights"
        )
    return None


# Files that hold a Hugging Face model's weights (one of them, or a sharded set's index).
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")


def model_folder_problems(cfg: JobConfig) -> list[Problem]:
    """Each model folder (model.path, a `model` reward term's path) names an architecture transformers
    knows and holds weights and a tokenizer the loaders read, checked here so that a broken folder
    stops the job naming the field instead of a worker's traceback. A config.json that is no model
    config ends the folder's checks (find_local_problems reports model.path's); a folder the runtime
    builds (`model.builder`) is not checked."""
    folders = [] if cfg.model.builder is not None else [("model.path", cfg.model.path)]
    folders += [(f"reward.terms[{i}].path", term.path) for i, term in enumerate(cfg.reward.terms) if term.path]
    if not folders:  # the tiny model's job: transformers' table of architectures costs ~0.5 s of CPU
        return []
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # heavy: only here

    from rldock.runtime.models.loading import TokenizerError, load_tokenizer, read_tokenizer

    problems = []
    for field, folder in folders:
        path, policy = Path(folder), field == "model.path"
        config = model_config_problem(path / "config.json")
        if config is not None:
            problems += [] if policy else [Problem(field, config)]
            continue
        model_type = json.loads((path / "config.json").read_bytes())["model_type"]
        if model_type not in CONFIG_MAPPING_NAMES:
            problems.append(
                Problem(
                    field,
                    f"{path}/config.json says model_type {model_type!r}, which this transformers does not "
                    "know; point it at a supported model (docs/bring-your-own.md#tested-architectures)",
                )
            )
        if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
            problems.append(
                Problem(
                    field,
                    f"{path} holds no weights ({', '.join(WEIGHT_PATTERNS)}; it holds: {_listing(path)}); point "
                    "it at a folder save_pretrained wrote",
                )
            )
        try:
            (load_tokenizer if policy else read_tokenizer)(path, field=field)
        except TokenizerError as error:
            problems.append(Problem(field, str(error).removeprefix(f"{field}: ")))
    return problems


def reward_function_problems(cfg: JobConfig) -> list[Problem]:
    """Each `file.py:name` reward term's file parses and defines `name` at its top level, as a
    function of one of the two reward forms (rewards/forms.py: verl's or TRL's, the same check the
    reward worker makes on the loaded function) and not as a literal (`compute_score = 3`). Read as
    source, not imported: the reward worker imports it (running the user's code) where it runs;
    here a typo in the name, the file's syntax or a signature that fits neither form is caught
    before anything starts. A decorated function, or a name bound by an import or a call, is left to
    the worker, whose check runs before any model work."""
    named = [(f"reward.terms[{index}].function", term.function) for index, term in enumerate(cfg.reward.terms)]
    return _definition_problems(named, kind="function")


def agent_class_problems(cfg: JobConfig) -> list[Problem]:
    """As reward_function_problems, for the agent's own tool and environment classes given as
    `file.py:Class` (the actor imports them where it runs)."""
    if cfg.agent is None:
        return []
    named = [(f"agent.tools[{index}].name", tool.name) for index, tool in enumerate(cfg.agent.tools)]
    if cfg.agent.environment is not None:
        named.append(("agent.environment.name", cfg.agent.environment.name))
    return _definition_problems(named, kind="class")


def harness_problems(cfg: JobConfig) -> list[Problem]:
    """The harness imports (running its module's top level, as the actor will) and is an `async def` of
    (task, client); a command's program is found on the PATH; a captured first request parses."""
    if cfg.agent is None:
        return []
    if cfg.agent.harness_request is not None:
        try:
            read_harness_request(cfg.agent.harness_request)
        except HarnessRequestError as error:
            return [Problem(HARNESS_REQUEST, str(error).removeprefix(f"{HARNESS_REQUEST}: "))]
    if cfg.agent.harness is not None:
        try:
            load_harness(cfg.agent.harness)
        except ValueError as error:
            return [Problem("agent.harness", str(error).removeprefix("agent.harness: "))]
    command = cfg.agent.harness_command
    if command and shutil.which(command[0]) is None:
        if "/" in command[0]:  # there (the path checks ran first), but not to be run
            fix = f"make it executable (chmod +x) or run it with its interpreter ([python, {command[0]}])"
            return [Problem("agent.harness_command[0]", f"{command[0]} is not executable; {fix}")]
        return [Problem("agent.harness_command", f"{command[0]!r} is not an executable on the PATH; name the program")]
    return []


def _definition_problems(named: Sequence[tuple[str, str | None]], *, kind: str) -> list[Problem]:
    """For each (field, reference) whose reference is `file.py:name`: the file defines `name`."""
    problems = []
    for field, reference in named:
        target, _, name = (reference or "").rpartition(":")
        if target.endswith(".py"):
            message = _definition_problem(Path(target), name, kind=kind, reference=str(reference))
            if message is not None:
                problems.append(Problem(field, message))
    return problems


def _module_level(statements: list[ast.stmt]):
    """The statements that run when the module is imported: the top level and the branches of its
    if/try/with blocks (a definition in `try: ... except ImportError: ...` counts), not bodies of
    functions or classes."""
    for node in statements:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]
            for block in blocks:
                yield from _module_level(block)


def _definition_problem(path: Path, name: str, *, kind: str, reference: str) -> str | None:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except SyntaxError as error:  # (null bytes too, which have no line)
        where = f" line {error.lineno}" if error.lineno is not None else ""
        return f"{path}{where} is not valid Python: {error.msg}"
    defined: dict[str, ast.stmt] = {}  # name -> the last module-level statement that binds it
    for node in _module_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[node.name] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None  # a star import may define it: the reward worker's import decides
            defined.update(((alias.asname or alias.name).split(".")[0], node) for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(
                (named.id, node) for target in targets for named in ast.walk(target) if isinstance(named, ast.Name)
            )
    if name in defined:
        return _function_problem(reference, defined[name]) if kind == "function" else None
    shapes = (ast.ClassDef,) if kind == "class" else (ast.FunctionDef, ast.AsyncFunctionDef)
    listed = sorted(node.name for node in tree.body if isinstance(node, shapes))
    plural = "classes" if kind == "class" else "functions"
    return f"{path} defines no {name!r} at its top level (its {plural}: {listed}); name one of them after the colon"


def _function_problem(reference: str, binding: ast.stmt) -> str | None:
    """What is wrong with the statement that binds a reward function's name, as far as its source
    tells: a literal is no function; a plain `def` must have a reward form's signature."""
    if isinstance(binding, (ast.Assign, ast.AnnAssign)) and binding.value is not None:
        try:
            value = ast.literal_eval(binding.value)
        except (ValueError, TypeError):  # not a literal (a call, a lambda, a name): the worker's load decides
            return None
        return wrong_kind(reference, type(value).__name__, "function")
    if isinstance(binding, (ast.FunctionDef, ast.AsyncFunctionDef)) and not binding.decorator_list:
        from rldock.runtime.rewards.forms import form_problem, signature_of  # imports torch: only here

        problem = form_problem(signature_of(binding))
        return None if problem is None else f"{reference} {problem}"
    return None


def output_problems(output: str | Path) -> list[Problem]:
    """The output directory is writable, or can be made in its nearest existing parent."""
    path = Path(output)
    existing = path if path.exists() else _nearest_existing(path)
    if not existing.is_dir():
        return [Problem(OUTPUT_FIELD, f"{path}: {existing} is not a directory")]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [
            Problem(
                OUTPUT_FIELD,
                f"{path}: {existing} is not writable by this process (uid {os.getuid()}); "
                "in an RLJob the output lies on the checkpoint volume (spec.checkpoint)",
            )
        ]
    return []


def preflight(cfg: JobConfig, *, output: str | Path | None = None) -> JobFailure | None:
    """Why the job must not start here, or None. Missing or unreadable paths come first; only when
    all are there are the checks that read them run (find_local_problems: the model's shape;
    model_folder_problems: each model folder's architecture, weights and tokenizer; data_file_problems:
    each data file opens, has the data section's keys and a prompt the chat template setting can
    render; reward_function_problems and agent_class_problems: each user file
    defines what it is named for; wandb_credentials_problems: W&B has an API key;
    local_device_problems: the GPUs a local Ray is asked for are here; environment_server_problems: the
    environment servers at a `url` answer OpenEnv's /health and /schema; sandbox_layer_problems: the
    python tool's sandbox has the kernel layers the config requires); only when those pass, the
    prompt sets are built as the trainer builds them (prompt_set_problems: a prompt within
    algorithm.max_prompt_length, every row readable)."""
    path_problems = find_path_problems(cfg) + (output_problems(output) if output is not None else [])
    if path_problems:
        return failure_of(FailureReason.PATH_NOT_FOUND, path_problems)
    local = (
        find_local_problems(cfg)
        + model_folder_problems(cfg)
        + data_file_problems(cfg.data)
        + reward_function_problems(cfg)
        + agent_class_problems(cfg)
        + harness_problems(cfg)
        + wandb_credentials_problems(cfg)
        + local_device_problems(cfg)
        + environment_server_problems(cfg, starting=output is not None)
        + sandbox_layer_problems(cfg)
    )
    if not local:
        local = prompt_set_problems(cfg)
    return failure_of(FailureReason.INVALID_JOB_INPUT, local) if local else None


def failure_of(reason: FailureReason, problems: Sequence[Problem]) -> JobFailure:
    return JobFailure(reason, tuple(FieldProblem(p.path, p.message) for p in problems))


def _nearest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _listing(path: Path) -> str:
    try:
        # Dot names left out: a mounted ConfigMap or Secret holds `..data` and a timestamped folder.
        names = sorted(entry.name for entry in path.iterdir() if not entry.name.startswith("."))
    except OSError as error:  # e.g. a folder that went away between the checks
        return f"unlistable: {error.strerror}"
    if not names:
        return "nothing"
    more = f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more
