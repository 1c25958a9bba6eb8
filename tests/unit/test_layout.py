"""The folder tree is the import tree: every Python file's path ends in its module path.

Checked twice: in the checkout (every file under a `src/` root resolves to itself by its dotted
name), and in a fresh, non-editable install of the `rldock` wheel, where every module of the
source trees is present, imports by its dotted name, and sits at the path its name says.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PRODUCT_ROOTS = [REPO / "api" / "src", REPO / "runtime" / "src", REPO / "operator" / "src"]
TOOLING_ROOTS = [REPO / "e2e" / "src", REPO / "benchmarks" / "src"]


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _source_modules(roots: list[Path]) -> dict[str, Path]:
    return {_module_name(path, root): path for root in roots for path in sorted(root.rglob("*.py"))}


def test_every_source_file_is_found_by_its_dotted_name():
    modules = _source_modules(PRODUCT_ROOTS + TOOLING_ROOTS)
    assert "rldock.runtime.dock.client" in modules and "rldock_e2e.doubles.kuberay" in modules
    for name, path in modules.items():
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).resolve() == path.resolve(), name


def test_code_lives_only_in_src_trees():
    """No Python file outside a src/ root, tests/ and examples/harnesses/ (a user's agent programs, named by
    path from a job, never imported by rldock); nothing called `operator` on top."""
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    stray = [f for f in tracked if "/src/" not in f and not f.startswith(("tests/", "examples/harnesses/"))]
    assert stray == []
    assert not (REPO / "operator" / "__init__.py").exists()


def test_nothing_edits_sys_path():
    pattern = re.compile(r"sys\.path\.(insert|append)")
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = [f for f in tracked if f != "tests/unit/test_layout.py" and pattern.search((REPO / f).read_text())]
    assert offenders == []


_IMPORT_EVERYTHING = textwrap.dedent("""
    import importlib, json, sys
    site, names = sys.argv[1], json.loads(sys.argv[2])
    paths = {}
    for name in names:
        module = importlib.import_module(name)
        paths[name] = module.__file__
    print(json.dumps(paths))
""")


@pytest.fixture(scope="module")
def fresh_install(tmp_path_factory) -> Path:
    """`pip install --no-deps` of the rldock wheel into a folder of its own."""
    work = tmp_path_factory.mktemp("fresh-install")
    # Built from a copy of what the wheel is made of: setuptools keeps a build/ folder beside the
    # sources, and a stale one in the checkout (a module since removed) would end up in the wheel.
    source = work / "source"
    for root in ("api/src", "runtime/src", "operator/src"):
        shutil.copytree(REPO / root, source / root, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(work / "dist"),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    wheel = next((work / "dist").glob("rldock-*.whl"))
    site = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    return site


def test_fresh_install_imports_every_module_from_its_own_path(fresh_install: Path):
    expected = _source_modules(PRODUCT_ROOTS)
    installed = {_module_name(path, fresh_install) for path in (fresh_install / "rldock").rglob("*.py")}
    assert installed == set(expected), "the wheel and the source trees hold different modules"
    # `-S`: no site-packages processing, so the checkout's editable install cannot answer; the
    # venv's site-packages comes after the fresh install only for third-party dependencies.
    names = sorted(name for name in expected if not name.endswith("__main__"))  # __main__ would run the operator
    deps = sysconfig.get_paths()["purelib"]
    out = subprocess.run(
        [sys.executable, "-S", "-c", _IMPORT_EVERYTHING, str(fresh_install), json.dumps(names)],
        env={"PYTHONPATH": f"{fresh_install}:{deps}", "PATH": "/usr/bin:/bin", "HOME": str(fresh_install)},
        capture_output=True,
        text=True,
        cwd=fresh_install.parent,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    paths = json.loads(out.stdout.strip().splitlines()[-1])
    for name, file in paths.items():
        relative = Path(file).resolve().relative_to(fresh_install.resolve())
        assert _module_name(fresh_install / relative, fresh_install) == name


# The module that runs the examples as their headers write them, through a shell: the header's
# command text is what that test checks, so it may not be rebuilt by tests/jobs.py.
HEADER_COMMANDS = "test_examples_as_written.py"


def train_launchers(folder: Path) -> list[str]:
    """The files under `folder` that start `rldock train` themselves: a Python `-m rldock.runtime.cli`
    argv or a `train` entry point, anywhere but tests/jobs.py."""
    launches = re.compile(r"""rldock\.runtime\.cli["'],\s*["']train["']|\bcli\.main\(\s*\[\s*["']train["']""")
    return sorted(
        path.name
        for path in folder.rglob("*.py")
        if path.name not in ("jobs.py", HEADER_COMMANDS) and launches.search(path.read_text())
    )


def test_integration_tests_run_jobs_only_through_the_suite_s_runner():
    assert train_launchers(REPO / "tests" / "integration") == []


def test_the_launcher_check_sees_a_job_started_by_hand(tmp_path):
    (tmp_path / "test_by_hand.py").write_text(
        'subprocess.run([sys.executable, "-m", "rldock.runtime.cli", "train", str(config)])\n'
    )
    (tmp_path / "test_runner.py").write_text("jobs.run(config, output)\n")
    assert train_launchers(tmp_path) == ["test_by_hand.py"]


@pytest.mark.parametrize("tree", ["api/src/rldock", "operator/src/rldock/operator", "runtime/src/rldock/runtime"])
def test_no_two_modules_of_a_tree_share_a_file_name(tree):
    """A file name says which module it is: two `layout.py` in one tree are two places a reader must
    tell apart by folder (Python's own `__init__.py` and `__main__.py` aside)."""
    homes: dict[str, list[str]] = {}
    for path in sorted((REPO / tree).rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts:
            homes.setdefault(path.name, []).append(str(path.relative_to(REPO / tree)))
    assert {name: paths for name, paths in homes.items() if len(paths) > 1} == {}


# agent/ is the agent loop, its tools and environments and their client; what grew beside it (the chat
# formats, the sandbox, the environment server) left for packages of their own (issue 65). 2,796 lines then.
MAX_AGENT_LINES = 3_000


def test_the_agent_package_stays_the_agent_loop_s_size():
    agent = REPO / "runtime" / "src" / "rldock" / "runtime" / "agent"
    lines = {
        str(path.relative_to(agent)): len(path.read_text().splitlines())
        for path in sorted(agent.rglob("*.py"))
        if "__pycache__" not in path.parts
    }
    assert sum(lines.values()) < MAX_AGENT_LINES, sorted(lines.items(), key=lambda item: -item[1])
