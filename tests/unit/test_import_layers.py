"""Imports follow docs/architecture.md's picture: the ground floor (`rldock.contract`,
`rldock.config`) imports nothing of ours above it, the runtime and the operator sit side by side
and never import each other, the operator never imports the ML stack, no product module imports
the benchmarks or the e2e harness, and inside the runtime the dock, the algorithms, the worker-state
specs and the schedules keep to their rooms, the worker side never imports the driver, and no two
of its folders import each other.

Read from the source with `ast` (every import statement, also those inside functions), so a lazy
import cannot hide a dependency the picture forbids.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = [REPO / "api" / "src", REPO / "runtime" / "src", REPO / "operator" / "src"]
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
ML_STACK = {"torch", "torch_npu", "ray", "vllm", "vllm_ascend", "mindspeed", "tensordict", "transformers", "peft"}
TOOLING = {"rldock_e2e", "rldock_benchmarks"}


def _modules() -> dict[str, Path]:
    found = {}
    for root in SOURCE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """Every absolute module `name` imports: `import a.b` gives a.b, `from a import b` gives a.b when
    a.b is one of our modules (a submodule), else a."""
    imported = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                imported.add(candidate if candidate in MODULES else node.module)
    return imported


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _top(name: str) -> str:
    return name.split(".")[0]


def _offenders(package: str, allowed) -> list[str]:
    """`module -> import` for every import of `package`'s modules that `allowed(import)` refuses."""
    return [
        f"{module} -> {imported}"
        for module in MODULES
        if _within(module, package)
        for imported in sorted(_imports(module))
        if not allowed(imported)
    ]


def test_the_scan_sees_the_trees():
    assert {"rldock.config.job", "rldock.contract.progress", "rldock.operator.handlers"} <= set(MODULES)
    assert "rldock.runtime.flow.states" in _imports("rldock.runtime.flow.catalogue")


def test_contract_imports_only_the_standard_library():
    assert _offenders("rldock.contract", lambda i: _top(i) in STDLIB or _within(i, "rldock.contract")) == []


def test_config_imports_only_pydantic_yaml_and_the_contract():
    def allowed(i: str) -> bool:
        return (
            _top(i) in STDLIB | {"pydantic", "pydantic_core", "yaml"}
            or _within(i, "rldock.config")
            or _within(i, "rldock.contract")
        )

    assert _offenders("rldock.config", allowed) == []


def test_operator_never_imports_the_runtime_or_the_ml_stack():
    def allowed(i: str) -> bool:
        return not _within(i, "rldock.runtime") and _top(i) not in ML_STACK

    assert _offenders("rldock.operator", allowed) == []


def test_runtime_never_imports_the_operator():
    assert _offenders("rldock.runtime", lambda i: not _within(i, "rldock.operator")) == []


@pytest.mark.parametrize("package", ["rldock.config", "rldock.contract", "rldock.runtime", "rldock.operator"])
def test_no_product_module_imports_the_tooling(package):
    assert _offenders(package, lambda i: _top(i) not in TOOLING) == []


# Rooms inside the runtime (architecture.md's module table): what each must not reach into.
RUNTIME_ROOMS = {
    # The dock moves samples: it knows no worker, schedule, engine or the driver.
    "rldock.runtime.dock": (
        "rldock.runtime.workers",
        "rldock.runtime.driver.schedule",
        "rldock.runtime.driver.trainer",
        "rldock.runtime.engines",
        "rldock.runtime.training",
    ),
    # Algorithms are pure tensor functions (the recipes are the flow spec's): no Ray, no engines, no
    # workers, no flow spec.
    "rldock.runtime.algorithms": (
        "rldock.runtime.flow",
        "ray",
        "vllm",
        "rldock.runtime.workers",
        "rldock.runtime.engines",
        "rldock.runtime.driver.trainer",
        "rldock.runtime.driver.schedule",
    ),
    # The specs and the column groups are data the dock, trainer, placement and planner read.
    "rldock.runtime.flow.states": ("ray", "torch", "rldock.runtime.workers", "rldock.runtime.driver.trainer"),
    "rldock.runtime.flow.columns": ("ray", "torch"),
    # The schedules are driven by the trainer, never the other way round.
    "rldock.runtime.driver.schedule": ("rldock.runtime.driver.trainer",),
    # The training backends serve the actor; they do not drive iterations.
    "rldock.runtime.training": ("rldock.runtime.driver.trainer", "rldock.runtime.driver.schedule"),
    # The engines run in the workers: none imports the driver's metrics (driver/utilisation.py's count
    # reads the shapes they share from planning/shapes.py).
    "rldock.runtime.engines": (
        "rldock.runtime.driver.trainer",
        "rldock.runtime.driver.schedule",
        "rldock.runtime.driver.utilisation",
        "rldock.runtime.driver.records",
    ),
    # The rollout modes serve the actor's engine: no iteration order, no update, no actor.
    "rldock.runtime.rollout": (
        "rldock.runtime.driver.trainer",
        "rldock.runtime.driver.schedule",
        "rldock.runtime.training",
        "rldock.runtime.workers.actor",
    ),
    # The flow spec (states, columns, recipes) is data both halves read: no Ray, no workers, no engines,
    # no training backend, no driver.
    "rldock.runtime.flow": (
        "ray",
        "vllm",
        "rldock.runtime.workers",
        "rldock.runtime.engines",
        "rldock.runtime.training",
        "rldock.runtime.rollout",
        "rldock.runtime.driver",
    ),
    # The conversation's formats (chat rendering, tool-call parsers, cut turns) sit under the data, the agent
    # loop and the gateway, which all read them: none of those above it.
    "rldock.runtime.chat": ("rldock.runtime.agent", "rldock.runtime.data", "rldock.runtime.gateway"),
    # The data (files, generators, rendering, the feed's sampler) sits under the agent loop: an environment's own
    # rows live beside it (agent/examples/cabinet_tasks.py).
    "rldock.runtime.data": ("rldock.runtime.agent",),
    # The sandbox runs a program in a confined child and knows nothing of who calls it (the python tool, the
    # python sandbox environment).
    "rldock.runtime.sandbox": ("rldock.runtime.agent", "rldock.runtime.gateway", "rldock.runtime.rollout"),
    # The environment server serves an Environment of agent's interfaces to its clients (OpenEnv's protocol):
    # it sits above agent/, which is its client and never imports it, and knows no rollout or gateway.
    "rldock.runtime.agent": ("rldock.runtime.env_server",),
    "rldock.runtime.env_server": ("rldock.runtime.rollout", "rldock.runtime.gateway", "rldock.runtime.dock"),
}
# The worker side never reaches into the driver process: the driver starts workers and reads their results,
# never the other way round. Added to a room's own rule above, not in its place.
for _side in (
    "workers",
    "engines",
    "training",
    "rollout",
    "dock",
    "agent",
    "chat",
    "sandbox",
    "env_server",
    "gateway",
    "models",
    "resharding",
):
    _room = f"rldock.runtime.{_side}"
    RUNTIME_ROOMS[_room] = (*RUNTIME_ROOMS.get(_room, ()), "rldock.runtime.driver")


@pytest.mark.parametrize("room", sorted(RUNTIME_ROOMS))
def test_runtime_rooms_keep_to_themselves(room):
    forbidden = RUNTIME_ROOMS[room]
    assert _offenders(room, lambda i: not any(_within(i, f) for f in forbidden)) == []


def _runtime_folder(name: str) -> str | None:
    """The runtime folder (a package right under rldock.runtime) a module or import belongs to."""
    parts = name.split(".")
    folder = ".".join(parts[:3])
    is_package = folder in MODULES and MODULES[folder].name == "__init__.py"
    return folder if parts[:2] == ["rldock", "runtime"] and len(parts) >= 3 and is_package else None


def test_no_two_runtime_folders_import_each_other():
    # A folder is a room with one job; two that import each other are one room in two places, and a
    # change to either can break the other. Each pair's imports, both ways, are listed on failure.
    edges: dict[tuple[str, str], list[str]] = {}
    for module in MODULES:
        for imported in _imports(module):
            source, target = _runtime_folder(module), _runtime_folder(imported)
            if source and target and source != target:
                edges.setdefault((source, target), []).append(f"{module} -> {imported}")
    cycles = {
        f"{a} <-> {b}": sorted(edges[a, b] + edges[b, a]) for (a, b) in sorted(edges) if a < b and (b, a) in edges
    }
    assert cycles == {}


def test_the_algorithms_are_pure_tensor_functions():
    """algorithms/ imports only the standard library, torch and the registry: the recipes that
    compose its functions into flows are the flow spec's (flow/catalogue.py)."""

    def allowed(i: str) -> bool:
        return (
            _top(i) in STDLIB | {"torch"}
            or _within(i, "rldock.runtime.algorithms")
            or i == "rldock.runtime.registry"
            or _within(i, "rldock.config")
            or _within(i, "rldock.contract")
        )

    assert _offenders("rldock.runtime.algorithms", allowed) == []


def import_cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module of `graph` (module -> the modules
    it imports): each is a set of modules that import one another, directly or round a loop
    (Tarjan's algorithm, iterative so a deep chain of imports cannot exhaust the stack)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            child = next((e for e in edges if e not in index or e in on_stack), None)
            if child is not None:
                if child in index:
                    low[node] = min(low[node], index[child])
                else:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while not component or component[-1] != node:
                    component.append(stack.pop())
                    on_stack.discard(component[-1])
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


@pytest.mark.parametrize("product", ["rldock.runtime", "rldock.operator"])
def test_no_module_imports_itself_round_a_loop(product):
    # Also through imports only a type checker runs (TYPE_CHECKING) and lazy ones inside functions:
    # two modules that need each other are one module in two files, and their order of import decides
    # whether either loads. A type both need lives in a module of its own (models/pass_cells.py).
    modules = [name for name in MODULES if _within(name, product)]
    graph = {
        name: sorted(i for i in _imports(name) if i in MODULES and i != name and _within(i, product))
        for name in modules
    }
    assert import_cycles(graph) == []


def test_the_cycle_check_sees_a_loop_and_not_a_chain():
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": [], "e": ["d"], "f": ["g"], "g": ["f"]}
    assert sorted(import_cycles(graph)) == [["a", "b", "c"], ["f", "g"]]
    assert import_cycles({"a": ["b"], "b": ["c"], "c": []}) == []
