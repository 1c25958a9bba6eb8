"""The agent section of an iteration's record, from several engines' episode sums."""

from __future__ import annotations

from collections import Counter

import pytest

from rldock.runtime.agent.episode_loop import Episode
from rldock.runtime.agent.episode_metrics import agent_metrics, episode_sums, merged_sums


def _episode(turns: int, model: int, tool: int, calls: dict, errors: dict, seconds: dict, ended: str) -> Episode:
    episode = Episode(prompt=[1], key=0, context=None)
    episode.add([5] * model, model=True)
    episode.add([6] * tool, model=False)
    episode.turns, episode.ended = turns, ended
    episode.tool_calls, episode.tool_errors, episode.tool_seconds = Counter(calls), Counter(errors), dict(seconds)
    return episode


def test_metrics_merge_engines_and_average_per_episode_and_per_call():
    first = episode_sums(
        [
            _episode(2, 6, 4, {"python": 1}, {"python": 0}, {"python": 0.5}, "answer"),
            _episode(3, 8, 8, {"python": 2}, {"python": 1}, {"python": 1.5}, "max_turns"),
        ]
    )
    second = episode_sums([_episode(1, 4, 0, {}, {}, {}, "answer")])
    section = agent_metrics([first, second])["agent"]
    assert section["turns_mean"] == pytest.approx(2.0)
    assert section["tool_calls_mean"] == pytest.approx(1.0) and section["tool_errors_mean"] == pytest.approx(1 / 3)
    assert section["calls/python"] == 3 and section["errors/python"] == 1
    assert section["latency_s/python"] == pytest.approx(2.0 / 3)
    assert section["model_token_share"] == pytest.approx(18 / 30)
    assert section["ended/answer"] == 2 and section["ended/max_turns"] == 1
    assert merged_sums([first, second])["episodes"] == 3


def test_the_tools_own_counts_are_summed_under_their_keys():
    counted = _episode(1, 4, 2, {"python": 2}, {"python": 0}, {"python": 0.2}, "answer")
    counted.tool_counts = Counter({"sandbox/without_landlock": 2})
    plain = _episode(1, 4, 0, {}, {}, {}, "answer")
    section = agent_metrics([episode_sums([counted]), episode_sums([counted, plain])])["agent"]
    assert section["sandbox/without_landlock"] == 4
    assert "sandbox/without_landlock" not in agent_metrics([episode_sums([plain])])["agent"]


def test_no_episodes_no_section():
    assert agent_metrics([]) == {}
