"""Building the agent section's tools, environment and parser: built-ins by name, the user's own classes
by reference, and errors that name the field to change."""

import sys
import textwrap

import pytest

from rldock.config.agent import BUILTIN_TOOLS, AgentSpec
from rldock.config.agent_environment import BUILTIN_ENVIRONMENTS
from rldock.runtime.agent.builders import AgentConfigError, build_environment, build_parser, build_tools
from rldock.runtime.agent.environments import FeedbackEnvironment
from rldock.runtime.agent.interfaces import ENVIRONMENTS, TOOLS
from rldock.runtime.chat.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS, HermesParser
from rldock.runtime.user_code import load_file

USER_FILE = textwrap.dedent("""
    from rldock.runtime.agent.interfaces import Environment, EnvironmentSession, Observation, Tool, ToolResult

    CLOSED = []

    class Echo(Tool):
        description = "Says the text back."
        parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

        def __init__(self, name="echo", prefix=""):
            self.name, self.prefix = name, prefix

        async def call(self, arguments):
            return ToolResult(self.prefix + str(arguments.get("text")))

        def close(self):
            CLOSED.append(self.name)

    class Nameless(Echo):
        def __init__(self):
            self.name = None

    class Unfinished(Tool):
        name = "unfinished"

    class Judge(Environment):
        def __init__(self, verdict="yes"):
            self.verdict = verdict

        def session(self):
            return Verdict()

    class Verdict(EnvironmentSession):
        async def reset(self, *, seed, episode_id, context):
            return Observation()

        async def step(self, text):
            return Observation(done=True)

    class NotATool:
        pass

    def helper():
        pass
""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_FILE)
    return path


def agent(**fields) -> AgentSpec:
    return AgentSpec.model_validate(fields)


def test_the_registries_hold_what_the_config_accepts():
    assert list(TOOLS) == sorted(BUILTIN_TOOLS)
    assert list(ENVIRONMENTS) == sorted(BUILTIN_ENVIRONMENTS)
    assert list(TOOL_CALL_PARSERS) == list(AgentSpec.model_fields["tool_call_format"].annotation.__args__)
    assert list(REASONING_PARSERS) == sorted(AgentSpec.model_fields["reasoning_format"].annotation.__args__)


def test_the_built_in_tools_by_name_beside_ones_own(user_file):
    tools = build_tools(agent(tools=[{"name": "calculator"}, {"name": f"{user_file}:Echo"}, {"name": "python"}]))
    try:
        assert list(tools) == ["calculator", "echo", "python"]
        assert type(tools["python"]) is TOOLS.get("python")
    finally:
        for tool in tools.values():
            tool.close()


def test_a_tool_of_ones_own_with_a_built_in_name_is_refused(user_file):
    spec = agent(tools=[{"name": "calculator"}, {"name": f"{user_file}:Echo", "options": {"name": "calculator"}}])
    with pytest.raises(AgentConfigError, match=r"^agent.tools\[1\].name: a second tool called 'calculator'"):
        build_tools(spec)


def test_a_tool_of_ones_own_from_a_file_gets_its_options(user_file):
    tools = build_tools(agent(tools=[{"name": f"{user_file}:Echo", "options": {"name": "say", "prefix": "> "}}]))
    assert list(tools) == ["say"] and tools["say"].prefix == "> "


def test_a_tool_of_ones_own_from_a_module_on_the_python_path(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    monkeypatch.delitem(sys.modules, "my_tools", raising=False)
    tools = build_tools(agent(tools=[{"name": "my_tools:Echo"}]))
    assert type(tools["echo"]).__name__ == "Echo"


def test_tools_are_keyed_by_the_name_the_model_calls_them_in_config_order(user_file):
    spec = agent(tools=[{"name": f"{user_file}:Echo", "options": {"name": n}} for n in ("b", "a")])
    assert list(build_tools(spec)) == ["b", "a"]


def test_no_tools_and_no_environment_build_to_nothing():
    assert build_tools(agent()) == {} and build_environment(agent()) is None


def test_the_feedback_environment_and_one_of_ones_own(user_file):
    assert isinstance(build_environment(agent(environment={"name": "feedback"})), FeedbackEnvironment)
    judge = build_environment(agent(environment={"name": f"{user_file}:Judge", "options": {"verdict": "no"}}))
    assert type(judge).__name__ == "Judge" and judge.verdict == "no"


def test_the_parser_of_the_configured_format():
    assert isinstance(build_parser(agent()), HermesParser)


@pytest.mark.parametrize(
    "tool, words",
    [
        ({"name": "{dir}/missing.py:Echo"}, r"^agent.tools\[0\].name: no file .*missing.py"),
        ({"name": "{dir}/my_tools.py:Nope"}, r"^agent.tools\[0\].name: .* has no attribute 'Nope'; its classes: \["),
        ({"name": "{dir}/my_tools.py:helper"}, r"^agent.tools\[0\].name: .*:helper is a function, not a class"),
        ({"name": "{dir}/my_tools.py:NotATool"}, r"^agent.tools\[0\].name: .* is not a subclass of .*interfaces.Tool"),
        ({"name": "{dir}/my_tools.py:Judge"}, r"^agent.tools\[0\].name: .* is not a subclass of .*interfaces.Tool"),
        ({"name": "{dir}/my_tools.py:Unfinished"}, r"^agent.tools\[0\].name: .* does not define call"),
        ({"name": "{dir}/my_tools.py:Nameless"}, r"^agent.tools\[0\].name: .* has no `name`"),
        ({"name": "rldock_no_such_module:Echo"}, r"^agent.tools\[0\].name: cannot import module"),
        (
            {"name": "{dir}/my_tools.py:Echo", "options": {"colour": "red"}},
            r"^agent.tools\[0\].options: Echo cannot be made with options \{'colour': 'red'\}: .*'colour'",
        ),
    ],
)
def test_a_tool_that_cannot_be_built_names_the_field(user_file, tool, words):
    tool = {key: value.format(dir=user_file.parent) if key == "name" else value for key, value in tool.items()}
    with pytest.raises(AgentConfigError, match=words):
        build_tools(agent(tools=[tool]))


def test_an_environment_that_is_a_tool_names_the_environment_field(user_file):
    not_an_environment = r"^agent.environment.name: .* not a subclass of .*interfaces.Environment"
    with pytest.raises(AgentConfigError, match=not_an_environment):
        build_environment(agent(environment={"name": f"{user_file}:Echo"}))


def test_an_option_given_to_the_feedback_environment_names_the_options_field():
    with pytest.raises(AgentConfigError, match=r"^agent.environment.options: FeedbackEnvironment cannot be made"):
        build_environment(agent(environment={"name": "feedback", "options": {"tries": "2"}}))


def test_two_tools_with_one_name_name_the_second_and_close_what_was_built(user_file):
    spec = agent(tools=[{"name": f"{user_file}:Echo", "options": {"name": n}} for n in ("a", "b", "a")])
    with pytest.raises(AgentConfigError, match=r"^agent.tools\[2\].name: a second tool called 'a' \(agent.tools\[0\]"):
        build_tools(spec)
    assert load_file(user_file, field="test").CLOSED == ["a", "b", "a"]
