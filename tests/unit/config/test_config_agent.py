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


@pytest.mark.parametrize("name", ["ppo", "pf_ppo"])
@pytest.mark.parametrize("gae_unit", ["token", "turn"])
def test_a_critic_runs_with_an_agent_by_token_or_by_turn(agent_data, name, gae_unit):
    agent_data["algorithm"].update(name=name, gae_unit=gae_unit)
    cfg = parse_job_config(agent_data)
    assert cfg.algorithm.gae_unit == gae_unit


def _turn_credit(agent_data: dict, name: str = "grpo") -> dict:
    agent_data["algorithm"].update(name=name, credit="turn", turn_discount=0.9)
    agent_data["reward"] = {"terms": [{"name": "environment"}, {"name": "format", "pattern": "x", "weight": 0.1}]}
    return agent_data


@pytest.mark.parametrize("name", ["grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_turn_credit_with_an_environment_whose_steps_make_the_reward_is_valid(agent_data, name):
    cfg = parse_job_config(_turn_credit(agent_data, name))
    assert (cfg.algorithm.credit, cfg.algorithm.turn_discount) == ("turn", 0.9)


def test_turn_credit_for_a_critic_takes_no_turn_discount(agent_data):
    data = _turn_credit(agent_data, "ppo")
    assert any("algorithm.ppo.gamma" in m for m in problem_messages(data, "algorithm.turn_discount"))
    data["algorithm"]["turn_discount"] = 1.0
    assert parse_job_config(data).algorithm.credit == "turn"


@pytest.mark.parametrize(
    "change, path, words",
    [
        ({"algorithm": {"name": "dapo"}}, "algorithm.credit", "dapo has no turn-level estimator"),
        ({"agent": {"environment": None}}, "algorithm.credit", "neither agent.environment nor a harness"),
        ({"reward": {"terms": [{"name": "format", "pattern": "x"}]}}, "reward.terms", "not 0 environment term(s)"),
        ({"reward": {"terms": [{"name": "environment", "aggregate": "last"}]}}, "reward.terms", "aggregate last"),
        ({"reward": {"terms": [{"name": "environment", "weight": 2}]}}, "reward.terms", "weight 2"),
        (
            {"reward": {"terms": [{"name": "environment"}, {"name": "environment"}]}},
            "reward.terms",
            "not 2 environment term(s)",
        ),
    ],
)
def test_what_turn_credit_cannot_run_with_is_named_with_the_fix(agent_data, change, path, words):
    data = _turn_credit(agent_data)
    for section, values in change.items():
        data[section].update(values)
    assert len([message for message in problem_messages(data, path) if words in message]) == 1


@pytest.mark.parametrize(
    "harness", [{"harness": "my_agent:run"}, {"harness_command": ["python", "agent.py"]}, {"harness_pods": True}]
)
def test_turn_credit_with_a_harness_whose_posted_rewards_make_the_reward_is_valid(agent_data, harness):
    data = _turn_credit(agent_data)
    data["agent"] = {**harness, "max_segments": 1}
    cfg = parse_job_config(data)
    assert cfg.algorithm.credit == "turn" and cfg.agent is not None and cfg.agent.harnessed
    # an episode of several rows (segments) has turns the row-wise returns cannot follow
    data["agent"] = harness
    assert any("set agent.max_segments 1" in m for m in problem_messages(data, "agent.max_segments"))


def test_turn_credit_and_turn_gae_need_turns(agent_data):
    del agent_data["agent"]
    agent_data["algorithm"].update(credit="turn")
    assert any("no agent" in m for m in problem_messages(agent_data, "algorithm.credit"))
    agent_data["algorithm"].update(name="ppo", credit="trajectory", gae_unit="turn")
    assert any("one turn per response" in m for m in problem_messages(agent_data, "algorithm.gae_unit"))


def test_turn_gae_needs_a_critic_and_a_turn_discount_needs_turn_credit(agent_data):
    agent_data["algorithm"].update(gae_unit="turn")
    assert any("grpo has no critic" in m for m in problem_messages(agent_data, "algorithm.gae_unit"))
    agent_data["algorithm"].update(gae_unit="token", turn_discount=0.5)
    assert any("remove it" in m for m in problem_messages(agent_data, "algorithm.turn_discount"))


def test_a_harness_alone_is_valid_and_its_rewards_may_be_an_environment_term(agent_data):
    agent_data["agent"] = {"harness": "my_agent:run", "reasoning_format": "think", "tool_call_format": "qwen3_coder"}
    agent_data["reward"] = {"terms": [{"name": "environment"}]}
    cfg = parse_job_config(agent_data)
    assert cfg.agent is not None and cfg.agent.harness == "my_agent:run"
    parse_job_config({**agent_data, "agent": {"harness_command": ["python", "agent.py"]}})
    # held-out episodes run the harness too
    agent_data["data"]["generator"]["num_val_prompts"] = 8
    assert parse_job_config({**agent_data, "evaluation": {"interval": 5}}).evaluation.interval == 5


@pytest.mark.parametrize(
    "agent, path, words",
    [
        ({"harness": "my_agent:run", "tools": [{"name": "python"}]}, "agent.tools", "your harness runs the episode"),
        ({"harness": "a:run", "environment": {"name": "feedback"}}, "agent.environment", "remove agent.environment"),
        ({"harness": "a:run", "harness_command": ["python", "a.py"]}, "agent.harness_command", "keep one"),
    ],
)
def test_a_harness_with_rldocks_own_loop_is_refused(agent_data, agent, path, words):
    agent_data["agent"] = agent
    assert len([message for message in problem_messages(agent_data, path) if words in message]) == 1


def test_a_captured_harness_request_renders_a_harnesss_prompts_in_place_of_the_system_prompt(agent_data):
    agent_data["agent"] = {"harness_command": ["python", "agent.py"], "harness_request": "request.json"}
    assert parse_job_config(agent_data).agent.harness_request == "request.json"
    agent_data["data"]["system_prompt"] = "Add."
    assert any("the harness's, as it sent them" in m for m in problem_messages(agent_data, "data.system_prompt"))
    agent_data["agent"] = {"tools": [{"name": "calculator"}], "harness_request": "request.json"}
    assert any("set without a harness" in m for m in problem_messages(agent_data, "agent.harness_request"))


def test_a_harness_reference_that_is_not_module_colon_function_is_refused(agent_data):
    agent_data["agent"] = {"harness": "my_agent.run"}
    assert problem_messages(agent_data, "agent.harness")


def test_an_agents_episodes_may_be_cut_and_resumed_at_a_weight_update(agent_data):
    agent_data["training"] = {**agent_data.get("training", {}), "mode": "async"}
    agent_data["dock"] = {**agent_data.get("dock", {}), "max_staleness": 1}
    agent_data["rollout"] = {"partial_rollout": "resume", "max_tokens_per_round": 64}
    (message,) = problem_messages(agent_data, "rollout.importance_correction")
    assert "required" in message and "`decoupled`" in message  # the correction must be named
    agent_data["rollout"]["importance_correction"] = "decoupled"
    assert parse_job_config(agent_data).rollout.partial_rollout == "resume"


@pytest.mark.parametrize("harness", [{"harness": "my_agent:run"}, {"harness_command": ["my-agent"]}])
def test_a_harnesss_episodes_may_be_resumed_at_a_weight_update_never_dropped(agent_data, harness):
    agent_data["training"] = {**agent_data.get("training", {}), "mode": "async"}
    agent_data["dock"] = {**agent_data.get("dock", {}), "max_staleness": 1}
    agent_data["reward"] = {"terms": [{"name": "environment"}]}
    agent_data["agent"] = harness
    agent_data["rollout"] = {"partial_rollout": "resume", "max_tokens_per_round": 64}
    (message,) = problem_messages(agent_data, "rollout.importance_correction")
    assert "required" in message  # its episodes span two versions as the native loop's do
    agent_data["rollout"]["importance_correction"] = "behaviour"
    assert parse_job_config(agent_data).rollout.partial_rollout == "resume"
    agent_data["rollout"]["partial_rollout"] = "drop"
    (message,) = problem_messages(agent_data, "rollout.partial_rollout")
    assert "`drop` with agent: a harness's episode" in message and "use `resume`" in message


def test_an_importance_correction_is_read_only_with_partial_rollout_and_not_by_gspo(agent_data):
    agent_data["rollout"] = {"importance_correction": "behaviour"}
    (message,) = problem_messages(agent_data, "rollout.importance_correction")
    assert "only with rollout.partial_rollout" in message
    agent_data["training"] = {**agent_data.get("training", {}), "mode": "async"}
    agent_data["dock"] = {**agent_data.get("dock", {}), "max_staleness": 1}
    agent_data["rollout"] = {
        "partial_rollout": "resume",
        "max_tokens_per_round": 64,
        "importance_correction": "decoupled",
    }
    agent_data["algorithm"]["name"] = "gspo"
    (message,) = problem_messages(agent_data, "rollout.importance_correction")
    assert "per sequence" in message


@pytest.mark.parametrize("correction", [None, "behaviour"])
def test_an_importance_cap_nothing_reads_is_refused(agent_data, correction):
    agent_data["training"] = {**agent_data.get("training", {}), "mode": "async"}
    agent_data["dock"] = {**agent_data.get("dock", {}), "max_staleness": 1}
    agent_data["rollout"] = {"partial_rollout": "resume", "max_tokens_per_round": 64, "importance_cap": 3.0}
    if correction:
        agent_data["rollout"]["importance_correction"] = correction
    (message,) = problem_messages(agent_data, "rollout.importance_cap")
    assert "decoupled" in message
    agent_data["rollout"]["importance_correction"] = "decoupled"
    assert parse_job_config(agent_data).rollout.importance_cap == 3.0


def test_held_out_evaluation_with_agent_pods_is_refused(agent_data):
    agent_data["agent"] = {"harness_pods": True}
    agent_data["reward"] = {"terms": [{"name": "environment"}]}
    agent_data["evaluation"] = {"interval": 5}
    assert any("agent pods' episodes" in m for m in problem_messages(agent_data, "evaluation.interval"))


def test_a_harnesss_episodes_take_max_segments_rows_each_in_the_dock(agent_data):
    agent_data["agent"] = {"harness": "my_agent:run", "max_segments": 3}
    agent_data["reward"] = {"terms": [{"name": "environment"}]}
    cfg = parse_job_config(agent_data)
    algo = cfg.algorithm
    assert cfg.rows_per_episode == 3 and cfg.rows_per_group == 3 * algo.num_responses_per_prompt
    assert cfg.num_samples_per_iteration == algo.num_prompts_per_iteration * algo.num_responses_per_prompt * 3
    # rldock's own loop keeps one row per episode, whatever the field says
    agent_data["agent"] = {"tools": [{"name": "calculator"}], "environment": {"name": "feedback"}, "max_segments": 3}
    assert parse_job_config(agent_data).rows_per_episode == 1


def test_segments_are_refused_with_a_critic_naming_the_field(agent_data):
    agent_data["agent"] = {"harness": "my_agent:run", "max_segments": 2}
    agent_data["reward"] = {"terms": [{"name": "environment"}]}
    agent_data["algorithm"] = {**agent_data["algorithm"], "name": "ppo"}
    assert any("critic" in m and "max_segments: 1" in m for m in problem_messages(agent_data, "agent.max_segments"))
    agent_data["agent"]["max_segments"] = 1
    assert parse_job_config(agent_data).rows_per_episode == 1


CARRY = {"partial_rollout": "carry", "importance_correction": "behaviour"}


def carry_job(agent_data: dict) -> dict:
    return {**agent_data, "rollout": dict(CARRY), "dock": {**agent_data.get("dock", {}), "max_staleness": 1}}


def test_carried_episodes_are_a_sync_agent_job_setting_bounded_by_max_staleness(agent_data):
    cfg = parse_job_config(carry_job(agent_data))
    assert (cfg.rollout.partial_rollout, cfg.training.mode, cfg.dock.max_staleness) == ("carry", "sync", 1)


@pytest.mark.parametrize(
    ("change", "path", "words"),
    [
        ({"training": {"mode": "async"}}, "training.mode", "use training.mode sync"),
        ({"dock": {"max_staleness": 0}}, "dock.max_staleness", "at least 1"),
        ({"rollout": {"max_tokens_per_round": 8}}, "rollout.max_tokens_per_round", "not by tokens"),
        ({"rollout": {"importance_correction": None}}, "rollout.importance_correction", "required"),
        ({"agent": {"harness": "my_agent:run"}}, "rollout.partial_rollout", "native agent loop"),
        ({"algorithm": {"name": "dapo"}}, "rollout.partial_rollout", "sampling rounds"),
    ],
)
def test_what_carried_episodes_cannot_combine_with_is_named(agent_data, change, path, words):
    data = carry_job(agent_data)
    for section, values in change.items():
        data[section] = {**data.get(section, {}), **values}
    assert len([message for message in problem_messages(data, path) if words in message]) == 1


def test_carried_episodes_need_an_agent(agent_data):
    data = carry_job(agent_data)
    del data["agent"]
    assert [m for m in problem_messages(data, "rollout.partial_rollout") if "needs an agent section" in m]
