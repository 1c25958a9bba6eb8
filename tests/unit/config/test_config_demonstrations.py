"""Config rules of tool-use demonstrations: a generator writes them to data.demonstration_key's column,
and they need an agent section with the demonstrated tool."""

import pytest
from job_examples import example

from rldock.config import ConfigError, parse_job_config


@pytest.fixture
def agent_data() -> dict:
    data = example()
    data["data"]["chat_template"] = "model"
    data["data"]["generator"]["tool_demonstrations"] = "python"
    data["algorithm"]["max_response_length"] = 512
    data["agent"] = {"tools": [{"name": "python"}], "max_turns": 3}
    return data


def messages(data: dict, path: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return [p.message for p in caught.value.problems if p.path == path]


def test_generated_demonstrations_with_the_tool_in_agent_tools_are_valid(agent_data):
    cfg = parse_job_config(agent_data)
    assert cfg.data.generator is not None and cfg.data.generator.tool_demonstrations == "python"
    assert cfg.data.demonstration_key is None  # the generator's column is then `demonstration`
    agent_data["data"]["demonstration_key"] = "solved"
    assert parse_job_config(agent_data).data.demonstration_key == "solved"


def test_demonstrations_from_files_with_an_agent_are_valid(agent_data):
    del agent_data["data"]["generator"]
    agent_data["data"]["train_files"] = ["/data/train.jsonl"]
    agent_data["data"]["demonstration_key"] = "demonstration"
    assert parse_job_config(agent_data).data.demonstration_key == "demonstration"


def test_a_demonstration_key_the_generator_does_not_write_is_named(agent_data):
    del agent_data["data"]["generator"]["tool_demonstrations"]
    agent_data["data"]["demonstration_key"] = "demonstration"
    (message,) = messages(agent_data, "data.demonstration_key")
    assert "data.generator.tool_demonstrations" in message and "leave data.demonstration_key unset" in message


def test_a_demonstrated_tool_missing_from_agent_tools_is_named(agent_data):
    agent_data["data"]["generator"]["tool_demonstrations"] = "calculator"
    (message,) = messages(agent_data, "data.generator.tool_demonstrations")
    assert "calculator tool, which agent.tools does not list" in message


@pytest.mark.parametrize(
    "demonstrations, path",
    [
        ({"generator": {"name": "addition", "tool_demonstrations": "python"}}, "data.generator.tool_demonstrations"),
        ({"generator": None, "train_files": ["/d.jsonl"], "demonstration_key": "demo"}, "data.demonstration_key"),
    ],
)
def test_demonstrations_without_an_agent_are_named(demonstrations, path):
    data = example()
    data["data"].update(demonstrations)
    (message,) = messages(data, path)
    assert "add agent" in message


def test_max_factor_defaults_to_one_digit_factors():
    cfg = parse_job_config(example())
    assert cfg.data.generator is not None and cfg.data.generator.max_factor == 10
    assert cfg.data.generator.tool_demonstrations is None
