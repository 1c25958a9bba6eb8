"""The operator classifies each round once, held by reading its source (rules.py, facts.py):

- each rule's test is written once: one `first_rule({...})` table of tests in the whole operator,
  in rules.classify, and no other Rule-keyed table of tests anywhere;
- the status and the actions are derived from one record of the round's facts and the rule that
  decided (compute_status(facts, rule), next_actions(facts, rule)): neither classifies again;
- what status.py decides is one short function per rule, none a screenful long.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from rldock.operator import actions, rules, status
from rldock.operator.facts import RoundFacts
from rldock.operator.rules import Rule

OPERATOR = Path(rules.__file__).parent
MAX_STATUS_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    return {str(p.relative_to(OPERATOR)): ast.parse(p.read_text()) for p in sorted(OPERATOR.rglob("*.py"))}


def _called(node: ast.AST) -> str | None:
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _rule_of(key: ast.expr | None) -> str | None:
    """`Rule.X` as "X"."""
    if isinstance(key, ast.Attribute) and isinstance(key.value, ast.Name) and key.value.id == "Rule":
        return key.attr
    return None


def rule_tests(modules: dict[str, ast.Module]) -> list[tuple[str, str]]:
    """(module, rule) for every test of a rule written in the operator: a lambda keyed by `Rule.X`."""
    found = []
    for path, tree in modules.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values):
                    rule = _rule_of(key)
                    if rule is not None and isinstance(value, ast.Lambda):
                        found.append((path, rule))
    return found


def test_each_rule_is_tested_once_in_classify():
    modules = _modules()
    tests = rule_tests(modules)
    assert {path for path, _ in tests} == {"rules.py"}, tests
    named = [rule for _, rule in tests]
    assert sorted(named) == sorted(rule.name for rule in Rule if rule is not Rule.STARTING), named
    callers = {path for path, tree in modules.items() for node in ast.walk(tree) if _called(node) == "first_rule"}
    assert callers == {"rules.py"}, callers
    [classify] = [
        node for node in ast.walk(modules["rules.py"]) if isinstance(node, ast.FunctionDef) and node.name == "classify"
    ]
    assert sum(_called(node) == "first_rule" for node in ast.walk(classify)) == 2  # before and after looking


def test_status_and_actions_take_the_facts_and_the_rule_and_do_not_classify():
    for derive in (status.compute_status, actions.next_actions):
        parameters = inspect.signature(derive).parameters
        assert [p.annotation for p in parameters.values()] == ["RoundFacts", "Rule"], derive
    for module in (status, actions):
        tree = ast.parse(Path(module.__file__).read_text())
        assert not any(_called(node) in {"classify", "first_rule"} for node in ast.walk(tree)), module.__name__
    assert RoundFacts.__module__ == "rldock.operator.facts"


def test_status_decides_in_short_functions():
    tree = ast.parse(Path(status.__file__).read_text())
    long = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > MAX_STATUS_FUNCTION_LINES
    }
    assert long == {}


def test_the_shape_check_finds_a_second_rule_test():
    """The check itself: a rule tested again elsewhere is found."""
    modules = _modules()
    modules["status.py"] = ast.parse("first_rule({Rule.SUSPENDED: lambda: spec.suspend})")
    assert ("status.py", "SUSPENDED") in rule_tests(modules)
