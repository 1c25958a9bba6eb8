"""The runtime's layout shows its two halves (docs/architecture.md, issue 49's Done-when): few modules
loose at the runtime's top (the driver's are in driver/, the flow spec in flow/, placement with the
workers), and no two modules of the runtime sharing a file name, so a file name says one idea. Its
unit tests mirror it (issue 60): a test sits in the folder of the package it tests, under the
module's name of today."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from rldock.runtime import registry

RUNTIME = Path(registry.__file__).parent
REPO = RUNTIME.parents[3]
TESTS = Path(__file__).resolve().parent
FILE_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w-]+\.py)")
MAX_LOOSE_MODULES = 8
# Python's own file names, one per package by design.
PACKAGE_FILES = {"__init__.py", "__main__.py"}

# Folders of tests/unit/runtime/ that mirror no package, each with its reason.
NOT_A_PACKAGE = {
    # The npu twin is a test double of the NPU (rldock_e2e.doubles.npu_twin), not a runtime package;
    # its tests run in a pytest process of their own (tests/conftest.py says why).
    "twin",
}
# Test files at the top of tests/unit/runtime/ that test the runtime across its packages, not one
# top-level module; each with what it covers.
CROSS_CUTTING = {
    # The runtime's folders and this test tree's mirror of them.
    "test_runtime_layout.py",
    # The driver's and the stages' shape, read from the source of driver/, flow/ and the workers' side.
    "test_driver_shape.py",
    # The docs' config snippets and every example config, validated as a user would (`rldock validate`).
    "test_doc_snippets.py",
    "test_examples.py",
    # Every registry of the runtime (algorithms, data, flow, models, rewards) against the config's fields.
    "test_registries.py",
    # No ValueError naming a config field anywhere in the runtime but those that need runtime facts (issue 65).
    "test_no_config_errors.py",
}


def loose_modules(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.py") if p.name not in PACKAGE_FILES)


def shared_file_names(root: Path) -> dict[str, list[str]]:
    homes = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name not in PACKAGE_FILES and "__pycache__" not in path.parts:
            homes[path.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in homes.items() if len(paths) > 1}


def subpackages(root: Path) -> set[str]:
    """Every package under `root`, at any depth, as its path from `root` ("driver/schedule")."""
    return {p.parent.relative_to(root).as_posix() for p in root.rglob("__init__.py") if p.parent != root}


def _shown(path: Path) -> str:
    return path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name


def mirror_problems(tests: Path, runtime: Path) -> list[str]:
    """Where the test tree `tests` fails to mirror the package `runtime`: a folder (holding Python
    files) that names no subpackage, or a test file at the top named after no top-level module."""
    packages = subpackages(runtime)
    modules = {Path(name).stem for name in loose_modules(runtime)}
    shown_tests, shown_runtime = _shown(tests), _shown(runtime)
    problems = []
    folders = {p.parent for p in tests.rglob("*.py") if "__pycache__" not in p.parts and p.parent != tests}
    for folder in sorted(folders):
        relative = folder.relative_to(tests)
        if relative.parts[0] not in NOT_A_PACKAGE and relative.as_posix() not in packages:
            problems.append(
                f"{shown_tests}/{relative.as_posix()}/ mirrors no package of {shown_runtime} "
                f"(its packages: {', '.join(sorted(packages))}): move its tests to the folder of the package "
                f"they test, or list the folder in NOT_A_PACKAGE with the reason"
            )
    for path in sorted(tests.glob("test_*.py")):
        name = path.stem.removeprefix("test_")
        if path.name not in CROSS_CUTTING and not any(name == m or name.startswith(f"{m}_") for m in modules):
            problems.append(
                f"{shown_tests}/{path.name} is named after no top-level module of {shown_runtime} "
                f"({', '.join(sorted(modules))}): move it to {shown_tests}/<package>/ of the package it tests, "
                f"named after today's module (test_<module>[_aspect].py), or, if it tests the whole runtime, "
                f"list it in CROSS_CUTTING with what it covers"
            )
    return problems


def test_at_most_eight_modules_are_loose_at_the_runtimes_top():
    loose = loose_modules(RUNTIME)
    assert len(loose) <= MAX_LOOSE_MODULES, loose


def test_no_two_runtime_modules_share_a_file_name():
    assert shared_file_names(RUNTIME) == {}


def test_the_halves_and_the_flow_spec_are_folders():
    assert {"driver", "workers", "flow"} <= {p.name for p in RUNTIME.iterdir() if (p / "__init__.py").exists()}


def test_the_architecture_doc_names_files_that_exist():
    """Every file path docs/architecture.md names (from the repo's root or the runtime's) exists: its
    pictures, its "where do I change X" table and its house-style examples point at this tree."""
    text = (REPO / "docs" / "architecture.md").read_text()
    named = sorted(set(FILE_PATH.findall(text)))
    assert "flow/states.py" in named
    assert [p for p in named if not (REPO / p).exists() and not (RUNTIME / p).exists()] == []


def test_the_unit_tests_mirror_the_runtimes_packages():
    problems = mirror_problems(TESTS, RUNTIME)
    assert not problems, "\n".join(problems)


def test_the_checks_see_a_crowded_top_and_a_shared_name(tmp_path):
    """Not blind: a tree with nine loose modules and one name in two folders fails both."""
    for i in range(9):
        (tmp_path / f"m{i}.py").write_text("")
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
        (tmp_path / folder / "base.py").write_text("")
    assert len(loose_modules(tmp_path)) == 9
    assert shared_file_names(tmp_path) == {"base.py": ["a/base.py", "b/base.py"]}


def test_the_mirror_check_sees_a_folder_and_a_file_named_after_nothing(tmp_path):
    """Not blind: a test folder with no package and a loose test of no top-level module are named;
    a package's folder at any depth, the twin's, a test of a module or of one aspect of it pass."""
    runtime, tests = tmp_path / "runtime", tmp_path / "tests"
    for package in ("a", "a/b"):
        (runtime / package).mkdir(parents=True)
        (runtime / package / "__init__.py").write_text("")
    (runtime / "__init__.py").write_text("")
    (runtime / "m.py").write_text("")
    for folder in ("a/b", "c", "twin", "d/__pycache__", "e"):
        (tests / folder).mkdir(parents=True)
    for name in ("a/b/test_x.py", "c/test_y.py", "twin/test_z.py", "test_m.py", "test_m_aspect.py", "test_mx.py"):
        (tests / name).write_text("")
    (tests / "test_registries.py").write_text("")
    (tests / "d" / "__pycache__" / "test_old.cpython-311.pyc").write_text("")
    problems = mirror_problems(tests, runtime)
    assert [problem.split(" ")[0] for problem in problems] == ["tests/c/", "tests/test_mx.py"]
    assert "list the folder in NOT_A_PACKAGE" in problems[0] and "test_<module>[_aspect].py" in problems[1]
