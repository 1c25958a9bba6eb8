"""The driver's and the stages' shape, held by reading the runtime's source (docs/architecture.md,
"The driver" and "A stage is a spec plus one call"):

- the trainer keeps restarts, the loop, records and checkpoints only: at most 350 lines and 12
  attributes (the job's inputs are driver/inputs.py's, an attempt's workers driver/attempt.py's);
- the job's recipe is built once by the driver (driver/inputs.py) and handed to the workers: no
  `job_recipe(` call in the worker side of the runtime, only in the driver's inputs and the
  memory planner (which runs without a job);
- a worker state's name is written once, in its spec (flow/states.py) and the recipe catalogue
  (flow/catalogue.py): everything else names a state through its spec (`ROLLOUT.name`,
  `@in_turn(ROLLOUT)`, `run_stage(bank, spec, ...)`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from rldock.runtime.flow import states

RUNTIME = Path(states.__file__).parents[1]
MAX_TRAINER_LINES, MAX_TRAINER_ATTRIBUTES = 350, 12
# Where the job's recipe may be built: the driver's inputs, the recipes' own module, the planner.
RECIPE_BUILDERS = {"driver/inputs.py", "flow/job_recipe.py", "planning/memory.py"}
CATALOGUE = {"flow/states.py", "flow/recipe.py", "flow/catalogue.py"}
STATE_NAMES = {value.name for value in vars(states).values() if isinstance(value, states.WorkerState)}
# State names that are also a dock column's or a worker group's: a literal of one of these is a
# state only where a state is expected (STATE_POSITIONS); elsewhere it is the column or group.
COLUMN_OR_GROUP = {"reward", "advantage", "reference"}
# Calls whose arguments name states, and the containers keyed by state.
STATE_CALLS = {"in_turn", "run_stage", "train_share", "run_inference_stage", "run_update_stage", "spec", "launch"}
STATE_KEYED = ("consumes", "produces", "states", "results", "finished", "launched", "skip")
# The memory planner's two phases are called "update" and "generation" (`rldock plan`'s report),
# an older vocabulary than the states': the word, not a state.
NOT_STATES = {("planning/report.py", "update")}


def _modules() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(RUNTIME)), ast.parse(p.read_text())) for p in sorted(RUNTIME.rglob("*.py"))]


def _trainer_attributes(tree: ast.Module) -> set[str]:
    [trainer] = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer"]
    names = set()
    for node in ast.walk(trainer):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            for leaf in ast.walk(target):
                if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                    names.add(leaf.attr)
    return names


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _state_positions(tree: ast.Module) -> set[int]:
    """ids of the string constants in a place where a state is meant."""
    positions = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node) in STATE_CALLS:
            positions.update(id(a) for a in node.args)
        keyed_get = isinstance(node, ast.Call) and _called_name(node) == "get" and node.args
        if keyed_get and isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value).endswith(STATE_KEYED):
            positions.add(id(node.args[0]))
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith(STATE_KEYED):
            positions.add(id(node.slice))
    return positions


def state_name_literals(modules: list[tuple[str, ast.Module]]) -> list[str]:
    found = []
    for path, tree in modules:
        if path in CATALOGUE:
            continue
        positions = _state_positions(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and node.value in STATE_NAMES):
                continue
            if (path, node.value) in NOT_STATES:
                continue
            if node.value in COLUMN_OR_GROUP and id(node) not in positions:
                continue
            found.append(f"{path}:{node.lineno}: {node.value!r}")
    return found


def test_the_trainer_keeps_only_restarts_the_loop_records_and_checkpoints():
    source = (RUNTIME / "driver/trainer.py").read_text()
    attributes = _trainer_attributes(ast.parse(source))
    assert len(source.splitlines()) <= MAX_TRAINER_LINES
    assert len(attributes) <= MAX_TRAINER_ATTRIBUTES, sorted(attributes)


def test_the_recipe_is_built_by_the_driver_and_handed_to_the_workers():
    calls = [
        f"{path}:{node.lineno}"
        for path, tree in _modules()
        if path not in RECIPE_BUILDERS
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _called_name(node) == "job_recipe"
    ]
    assert calls == []


def test_a_state_name_is_written_only_in_its_spec_and_the_recipe_catalogue():
    assert {"rollout", "update", "reward", "rollout_resume"} <= STATE_NAMES  # the specs are read
    assert state_name_literals(_modules()) == []


def test_the_check_finds_a_state_literal_where_a_state_is_meant():
    """The literal check is not blind: the decorators, stage loops and result lookups the runtime
    wrote state names in before the specs named them are found, a column of the same name is not."""
    worker = ast.parse(
        "@in_turn('reference')\n"
        "def compute(self, iteration):\n"
        "    run_stage(bank, 'reward', columns, fn)\n"
        "    rewards = results.get('reward', [])\n"
        "    batch['reward'] * 2\n"
        "    return self.recipe.consumes['actor_inference']\n"
    )
    assert [hit.split(": ")[1] for hit in state_name_literals([("workers/toy.py", worker)])] == [
        "'reference'",
        "'reward'",
        "'reward'",
        "'actor_inference'",
    ]
