"""Config rules of the agent section: what multi-turn rollouts need from the rest of the job."""

import pytest
from job_examples import example, problem_messages

from rldock.config import parse_job_config


@pytest.fixture
def agent_data() -> dict:
    data = example()
    data["data"]["chat_template"] = "model"
    data["algorithm"]["max_response_length"] = 512
    data["agent"] = {"tools": [{"name": "calculator"}], "environment": {"name": "feedback"}, "max_turns": 3}
    return data


def test_tools_and_an_environment_with_a_chat_template_are_valid(agent_data):
    cfg = parse_job_config(agent_data)
    assert cfg.agent is not None and [tool.name for tool in cfg.agent.tools] == ["calculator"]


def test_an_environment_alone_or_tools_alone_are_valid(agent_data):
    parse_job_config({**agent_data, "agent": {"environment": {"name": "feedback"}}})
    parse_job_config({**agent_data, "agent": {"tools": [{"name": "python"}]}})


@pytest.mark.parametrize(
    "change, path, words",
    [
        ({"algorithm": {"name": "dpo"}}, "agent", "samples no responses"),
        ({"algorithm": {"name": "ppo"}}, "algorithm.name", "GAE runs over contiguous"),
        ({"rollout": {"partial_rollout": "drop"}}, "rollout.partial_rollout", "with agent"),
        ({"rollout": {"stream_groups": 2}}, "rollout.stream_groups", "set 0"),
        ({"data": {"chat_template": "none"}}, "data.chat_template", "renders the tools"),
        ({"agent": {"tools": [], "environment": None}}, "agent", "neither tools nor an environment"),
        ({"agent": {"max_tool_response_tokens": 512}}, "agent.max_tool_response_tokens", "not below"),
        ({"agent": {"tools": [{"name": "python"}, {"name": "python"}]}}, "agent.tools[1].name", "agent.tools[0]"),
        ({"agent": {"tools": [{"name": "python", "options": {"a": "1"}}]}}, "agent.tools[0].options", "no options"),
        ({"agent": {"environment": {"name": "feedback", "options": {"a": "1"}}}}, "agent.environment.options", "takes"),
    ],
)
def test_what_an_agent_cannot_run_with_is_named_with_the_fix(agent_data, change, path, words):
    for section, values in change.items():
        agent_data[section].update(values)
    assert len([message for message in problem_messages(agent_data, path) if words in message]) == 1


def test_the_same_own_tool_twice_is_left_to_its_names(agent_data):
    """Two entries of one class may be two tools (options give each its name); the loader refuses a
    repeated `Tool.name` when it builds them."""
    own = {"name": "my_tools.py:Echo"}
    parse_job_config({**agent_data, "agent": {"tools": [own, own]}})


def test_without_agent_none_of_it_applies(agent_data):
    del agent_data["agent"]
    agent_data["rollout"] = {"stream_groups": 2}
    agent_data["data"]["chat_template"] = "none"
    assert parse_job_config(agent_data).agent is None
