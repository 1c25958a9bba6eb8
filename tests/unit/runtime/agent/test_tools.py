"""The built-in tools: registered by name, built from the agent section, and every bad argument or
expression an error result the model reads, never an exception."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from rldock.config.agent import AgentSpec, SandboxSpec
from rldock.runtime.agent.interfaces import TOOLS, Tool, ToolResult
from rldock.runtime.agent.tools import CalculatorTool, PythonTool


def call(tool: Tool, arguments: Mapping[str, Any]) -> ToolResult:
    return asyncio.run(tool.call(arguments))


def calculate(expression: str) -> ToolResult:
    return call(CalculatorTool(), {"expression": expression})


def test_the_built_ins_are_registered_under_their_names():
    assert TOOLS.get("python") is PythonTool and TOOLS.get("calculator") is CalculatorTool


def test_schemas_name_the_one_required_string_argument():
    for tool, argument in ((PythonTool(SandboxSpec()), "code"), (CalculatorTool(), "expression")):
        function = tool.schema()["function"]
        assert function["name"] == tool.name and function["description"]
        assert function["parameters"]["required"] == [argument]
        assert function["parameters"]["properties"][argument]["type"] == "string"


def test_the_python_tool_takes_the_agent_sections_sandbox_limits():
    agent = AgentSpec(tools=[{"name": "python"}], sandbox={"cpu_seconds": 2, "memory_mib": 128})
    tool = TOOLS.get("python").from_config(agent, {})
    assert isinstance(tool, PythonTool) and tool.limits == agent.sandbox


def test_python_returns_what_the_program_printed():
    assert call(PythonTool(SandboxSpec()), {"code": "print(6 * 7)"}) == ToolResult("42\n")


def test_python_counts_the_sandbox_layers_a_call_ran_without(monkeypatch):
    # Landlock missing (a kernel before 5.13) and unshare refused (a restricted pod); the filter held.
    from rldock.runtime.agent import tools
    from rldock.runtime.sandbox.runner import Layers, Outcome, SandboxResult

    async def without_landlock(code, limits):
        return SandboxResult(
            "1\n", "", 0, Outcome.OK, "1\n", Layers(namespaces=(), landlock=0, seccomp=True, reported=True)
        )

    monkeypatch.setattr(tools, "run_python", without_landlock)
    result = call(PythonTool(SandboxSpec()), {"code": "print(1)"})
    assert result.counts == {"sandbox/without_landlock": 1, "sandbox/without_namespaces": 1}
    monkeypatch.undo()  # here every layer holds: nothing to count
    assert call(PythonTool(SandboxSpec()), {"code": "print(1)"}).counts == {}


def test_python_says_when_a_program_printed_nothing():
    assert call(PythonTool(SandboxSpec()), {"code": "x = 1"}) == ToolResult("(the program printed nothing)")


def test_python_failures_are_errors_with_the_reason():
    # Only the sleep races the 1 s wall clock: under load the boot alone can take longer.
    tool = PythonTool(SandboxSpec())
    raised = call(tool, {"code": "raise ValueError('bad')"})
    assert raised.error and raised.text.endswith("ValueError: bad\n")
    slept = call(PythonTool(SandboxSpec(wall_seconds=1)), {"code": "import time\ntime.sleep(60)"})
    assert slept == ToolResult(
        "[stopped: the program ran for 1 s, its time limit]", error=True, counts={"sandbox/wall_limit": 1}
    )
    refused = call(tool, {"code": "import socket\nsocket.socket()"})
    assert refused.error and "the sandbox refused network access (socket.__new__)" in refused.text
    assert refused.counts == {"sandbox/refused": 1}
    assert raised.counts == {}  # the program's own error: nothing the sandbox stopped


@pytest.mark.parametrize("arguments", [{}, {"code": 42}, {"code": None}, {"program": "print(1)"}])
def test_python_without_a_code_string_is_an_error_result(arguments):
    result = call(PythonTool(SandboxSpec()), arguments)
    assert result.error and result.text.startswith('error: the argument "code" must be a string; got ')


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("2 ** -2", "0.25"),
        ("2 ** 0.5", "1.4142135623730951"),
        ("-3 ** 2", "-9"),
        ("(-3) ** 2", "9"),
        ("+4 - -4", "8"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("1.5e3 * 2", "3000.0"),
        (" 12345678901234567890 * 98765432109876543210 ", "1219326311370217952237463801111263526900"),
        ("10 ** 3000 // 10 ** 2999", "10"),
    ],
)
def test_calculator_values(expression, value):
    assert calculate(expression) == ToolResult(value)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("5 // 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "the result is too large"),
        ("2 ** 100000", "the result is too large"),
        ("(10 ** 2000) ** 2", "the result is too large"),
        ("10.0 ** 400", "the result is too large"),
        ("1e308 * 10", "the result is too large"),
        ("10 ** 400 / 1", "the result is too large"),
        ("(-8) ** (1 / 3)", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("", "not an arithmetic expression"),
        ("(" * 300 + "1" + ")" * 300, "not an arithmetic expression"),
        ("-" * 990 + "-1", "nested too deeply"),
        ("1" * 1001, "longer than 1000 characters"),
        ("__import__('os').system('true')", "is not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("True + 1", "'True' is not allowed"),
        ("2j * 2", "'2j' is not allowed"),
        ("[1] * 3", "is not allowed"),
        ("'a' * 3", "is not allowed"),
        ("1 < 2", "is not allowed"),
        ("1 << 100000", "is not allowed"),
    ],
)
def test_calculator_errors_are_error_results(expression, message):
    result = calculate(expression)
    assert result.error and result.text.startswith("error: ") and message in result.text


@pytest.mark.parametrize("arguments", [{}, {"expression": 3}, {"expr": "1+1"}])
def test_calculator_without_an_expression_string_is_an_error_result(arguments):
    result = call(CalculatorTool(), arguments)
    assert result.error and result.text.startswith('error: the argument "expression" must be a string; got ')


def test_the_calculators_nesting_limit_is_its_own_not_the_interpreters():
    # vLLM and torch raise sys's recursion limit in a worker: the same expression gets the same answer.
    import sys

    deep = "-" * 990 + "-1"
    previous = sys.getrecursionlimit()
    try:
        for limit in (previous, 100_000):
            sys.setrecursionlimit(limit)
            result = calculate(deep)
            assert result.error and "nested too deeply" in result.text, (limit, result)
    finally:
        sys.setrecursionlimit(previous)
    assert calculate("-" * 199 + "1") == ToolResult("-1")
