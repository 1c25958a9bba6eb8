"""The built-in tools: `python` (runs a program in the sandbox, sandbox/, in this process's
machine or, with agent.sandbox.servers, in the python sandbox environment's servers) and `calculator`
(evaluates an arithmetic expression). Importing this module registers them in agent.base.TOOLS."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rldock.config.agent import AgentSpec, SandboxSpec
from rldock.runtime.agent.interfaces import (
    TOOLS,
    EnvironmentUnavailable,
    EpisodeContext,
    SessionFailed,
    Tool,
    ToolResult,
)
from rldock.runtime.agent.service.env_client import OpenEnvEnvironment, describe
from rldock.runtime.sandbox.runner import Outcome, require_layers, run_python


def _string_parameter(name: str, description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": description}},
        "required": [name],
    }


def _no_options(name: str, options: Mapping[str, str]) -> None:
    # the config's agent checks refuse options to a built-in tool (rldock.config.agent)
    assert not options, f"the built-in tool {name!r} takes no options, got {sorted(options)}"


def _string_argument(arguments: Mapping[str, Any], name: str) -> str | ToolResult:
    """The argument, or the error the model reads when it is missing or not a string."""
    value = arguments.get(name)
    if not isinstance(value, str):
        got = "nothing" if value is None else type(value).__name__
        return ToolResult(f'error: the argument "{name}" must be a string; got {got}', error=True)
    return value


@TOOLS.register("python")
class PythonTool(Tool):
    name = "python"
    description = (
        "Run a Python 3 program and get what it prints (stdout, then stderr). Each call is a fresh "
        "interpreter: nothing is kept between calls, so print what you need. No network, no subprocesses."
    )
    parameters = _string_parameter("code", "The program's source code.")

    def __init__(self, limits: SandboxSpec, *, sandbox_urls: Sequence[str] = ()):
        self.limits, self.sandbox_urls = limits, list(sandbox_urls)
        self._service: OpenEnvEnvironment | None = None  # made at the first call: the driver only reads the schema

    @classmethod
    def from_config(
        cls, agent: AgentSpec, options: Mapping[str, str], *, sandbox_urls: Sequence[str] = ()
    ) -> PythonTool:
        _no_options(cls.name, options)
        if agent.sandbox.servers is None:  # programs run here: not on a machine that lacks a required layer
            require_layers(agent.sandbox)
        return cls(agent.sandbox, sandbox_urls=sandbox_urls)

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        code = _string_argument(arguments, "code")
        if isinstance(code, ToolResult):
            return code
        if self.limits.servers is not None:
            return await self._call_service(code)
        result = await run_python(code, self.limits)
        text = result.text or "(the program printed nothing)"
        counts = {f"sandbox/without_{layer}": 1 for layer in result.layers.missing}
        if result.outcome not in (Outcome.OK, Outcome.ERROR):  # what the sandbox stopped the program for
            counts[f"sandbox/{result.outcome.value}"] = 1
        return ToolResult(text, error=result.outcome is not Outcome.OK, counts=counts)

    async def _call_service(self, code: str) -> ToolResult:
        """The program run by the python sandbox environment's servers (agent/sandbox_service.py), one
        session per call with this job's limits; the answer is the one the in-process tool gives."""
        servers = self.limits.servers
        assert servers is not None
        if self._service is None:
            self._service = OpenEnvEnvironment(
                name=f"agent.sandbox.servers ({describe(servers)})", servers=servers, urls=self.sandbox_urls
            )
        limits = self.limits.model_dump(exclude={"servers", "allow_missing_layers"})  # the server's to say
        session = self._service.session()
        try:
            await session.reset(seed=0, episode_id="python", context=EpisodeContext("", "", {"sandbox": limits}))
            observation = await session.step(code)
        except (SessionFailed, EnvironmentUnavailable) as error:
            if isinstance(error, EnvironmentUnavailable) and error.fatal:
                raise
            return ToolResult(f"error: the python sandbox service failed: {error}", error=True)
        finally:
            await session.close()
        counts = observation.fields.get("counts")
        return ToolResult(
            observation.message or "(the program printed nothing)",
            error=bool(observation.fields.get("error")),
            counts={str(k): int(v) for k, v in counts.items()} if isinstance(counts, dict) else {},
        )


@TOOLS.register("calculator")
class CalculatorTool(Tool):
    name = "calculator"
    description = (
        "Evaluate an arithmetic expression on integers and decimals: + - * / // % ** and parentheses, "
        'e.g. "(3 + 4.5) * 2 ** 10".'
    )
    parameters = _string_parameter("expression", "The expression.")

    @classmethod
    def from_config(cls, agent: AgentSpec, options: Mapping[str, str]) -> CalculatorTool:
        _no_options(cls.name, options)
        return cls()

    async def call(self, arguments: Mapping[str, Any]) -> ToolResult:
        expression = _string_argument(arguments, "expression")
        if isinstance(expression, ToolResult):
            return expression
        try:
            return ToolResult(_format(evaluate(expression)))
        except CalculatorError as error:
            return ToolResult(f"error: {error}", error=True)


class CalculatorError(ValueError):
    """An expression the calculator cannot evaluate; the message is what the model reads."""


MAX_EXPRESSION_CHARS = 1000
# Integers up to this many bits (about 3,000 decimal digits): enough for any arithmetic a model
# checks by hand, and each operation on them takes microseconds, so no expression runs long.
MAX_INTEGER_BITS = 10_000
# Operators nested in one another: the walk below recurses once per level, so it stops here rather than
# at the interpreter's recursion limit, which libraries raise (the answer must not depend on what else
# the process imported).
MAX_NESTING = 200

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression, by a walk over its syntax tree (nothing is executed).
    Raises CalculatorError for anything else, and for results too large to be worth computing."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an arithmetic expression: {error.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression is nested too deeply") from None
    return _value(tree.body, depth=0)


def _value(node: ast.expr, *, depth: int) -> int | float:
    if depth > MAX_NESTING:
        raise CalculatorError(f"the expression is nested too deeply (more than {MAX_NESTING} operators in one another)")
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand, depth=depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, depth=depth + 1), _value(node.right, depth=depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(result, complex):
            raise CalculatorError("the result is not a real number (a negative number to a fractional power)")
        return _checked(result)
    raise CalculatorError(f"{ast.unparse(node)!r} is not allowed: only numbers, + - * / // % ** and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuses an integer power whose result would pass MAX_INTEGER_BITS, before computing it (9**9**9
    would take hours); float powers overflow on their own, at once."""
    # bit_length - 1 bits of the base, times the exponent, is a lower bound of the result's bits.
    if not (isinstance(base, int) and isinstance(exponent, int)) or abs(base) <= 1:
        return
    if (abs(base).bit_length() - 1) * exponent > MAX_INTEGER_BITS:
        raise CalculatorError("the result is too large")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INTEGER_BITS:
        raise CalculatorError("the result is too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is too large" if math.isinf(value) else "the result is not a number")
    return value


def _format(value: int | float) -> str:
    return str(value) if isinstance(value, int) else repr(value)
