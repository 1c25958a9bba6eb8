"""The runtime's layout shows its two halves (docs/architecture.md, issue 49's Done-when): few modules
loose at the runtime's top (the driver's are in driver/, the flow spec in flow/, placement with the
workers), and no two modules of the runtime sharing a file name, so a file name says one idea."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

from rldock.runtime import registry

RUNTIME = Path(registry.__file__).parent
REPO = RUNTIME.parents[3]
FILE_PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w-]+\.py)")
MAX_LOOSE_MODULES = 8
# Python's own file names, one per package by design.
PACKAGE_FILES = {"__init__.py", "__main__.py"}


def loose_modules(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.py") if p.name not in PACKAGE_FILES)


def shared_file_names(root: Path) -> dict[str, list[str]]:
    homes = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name not in PACKAGE_FILES and "__pycache__" not in path.parts:
            homes[path.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in homes.items() if len(paths) > 1}


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
