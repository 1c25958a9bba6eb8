"""A hostile environment server against the rollout's OpenEnv client: a real server process
(openenv_servers.hostile_server) answers each episode's step in one wrong way (an error whose data is not
an object, JSON nested 100,000 deep, a 5,000-digit integer, frames that are not UTF-8, NaN, inf and 1e39
rewards, a 64 MiB observation, an answer that never comes), and each such episode ends with its counted
reason while the rollout goes on; no reward that is not finite reaches the dock's columns.

The engine is test_episode_loop's scripted one; the model's turns are fixed, the environment's answers are what
is tested."""

from __future__ import annotations

import math
import string

import pytest
from openenv_servers import HOSTILE_ANSWERS, hostile_server
from test_episode_loop import ScriptedEngine, make_loop, run

from rldock.config.agent_environment import EnvironmentServersSpec
from rldock.runtime.agent.episode_metrics import agent_metrics, episode_sums
from rldock.runtime.agent.interfaces import EpisodeContext
from rldock.runtime.agent.service.env_client import OpenEnvEnvironment
from rldock.runtime.models.tiny import CHAT_TEMPLATE, train_char_tokenizer
from rldock.runtime.rollout.agent_episodes import episode_columns

TIMEOUT_S = 10.0  # agent.tool_timeout_s: the never-answering server's episode ends at it (the others answer at once)
# What each wrong answer ends its episode with; "good" answers right and the episode goes on to max_turns.
EXPECTED = {mode: "environment_protocol_error" for mode in HOSTILE_ANSWERS} | {
    "good": "max_turns",
    "never_answers": "environment_timeout",
}


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def hostile_url():
    with hostile_server("good") as url:
        yield url


def test_each_wrong_answer_ends_its_episode_with_a_counted_reason_and_the_rollout_goes_on(tokenizer, hostile_url):
    modes = sorted(HOSTILE_ANSWERS)
    environment = OpenEnvEnvironment(
        name="hostile", servers=EnvironmentServersSpec(url=hostile_url, sessions_per_replica=len(modes))
    )
    engine = ScriptedEngine(tokenizer, {key: ["4", "5"] for key in range(len(modes))})
    loop = make_loop(tokenizer, engine, [], environment=environment, max_turns=2, tool_timeout_s=TIMEOUT_S)
    # The reset's ground truth names the way the server answers that episode's step.
    contexts = [EpisodeContext(mode, "hostile") for mode in modes]
    episodes = run(loop, tokenizer, len(modes), contexts=contexts)

    assert {mode: episode.ended for mode, episode in zip(modes, episodes)} == EXPECTED
    section = agent_metrics([episode_sums(episodes, loop)])["agent"]
    assert section["ended/environment_protocol_error"] == len(modes) - 2
    assert section["ended/environment_timeout"] == 1
    assert section["environment/errors"] == len(modes) - 1 and section["environment/sessions_open"] == 0
    columns = episode_columns(episodes, max_response_length=200, max_turns=2, pad_token_id=0, policy_version=0)
    rewards = columns["environment_rewards"].flatten().tolist()
    assert all(math.isfinite(reward) for reward in rewards) and max(rewards) == 0.5  # the good episode's step
