"""The config package's house rules (issue 65): each section in a module of its own with its checks
beside its fields, no module over 400 lines, and every section's checks gathered by find_problems."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from rldock.config import agent, problems

CONFIG = Path(problems.__file__).parent
MAX_LINES = 400
# Section modules whose `problems` another section's calls rather than find_problems, with the reason.
CALLED_BY_ANOTHER = {
    # an agent's environment is checked only in a job with agent (agent.problems calls it)
    "agent_environment",
    # a harness's captured request, likewise (agent.problems calls it)
    "agent_harness",
}


def _modules_with_checks() -> set[str]:
    """The config modules that define a top-level `problems` function."""
    found = set()
    for path in CONFIG.glob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, ast.FunctionDef) and node.name == "problems" for node in tree.body):
            found.add(path.stem)
    return found


def test_no_config_module_is_over_400_lines():
    sizes = {path.name: len(path.read_text().splitlines()) for path in CONFIG.glob("*.py")}
    assert {name: lines for name, lines in sizes.items() if lines > MAX_LINES} == {}


def test_every_sections_checks_are_gathered_by_find_problems():
    gathered = {check.__module__.rsplit(".", 1)[-1] for check in problems.SECTION_CHECKS}
    assert _modules_with_checks() - CALLED_BY_ANOTHER == gathered
    for module in CALLED_BY_ANOTHER:  # the exceptions' caller
        assert f"{module}.problems(cfg)" in inspect.getsource(agent.problems)
    assert {"agent", "algorithm", "data", "reward", "rollout", "training"} <= gathered
