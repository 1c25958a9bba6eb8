"""Partial rollout's prefix bookkeeping (rollout/partial.py): which responses a round budget
cuts, what the second round feeds the engine, how prefix and continuation join, which logprobs the
old-logprob pass keeps, and the two rounds end to end over a test double of the engine."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_doubles import EOS, PAD, EngineDouble, RecordingDock, completion, prompts_of

from rldock.runtime.engines.vllm_rollout import Completion
from rldock.runtime.flow.states import ROLLOUT
from rldock.runtime.rollout.partial import (
    CUT_POLICIES,
    PartialRollout,
    behaviour_logprobs,
    complete,
    is_cut,
    response_columns,
)
from rldock.runtime.rollout.protocol import RolloutRequest, RolloutSetup


def test_a_response_is_cut_when_the_budget_stopped_it_before_eos():
    assert is_cut(completion([5, 6, 7], -1.0), round_tokens=3)
    assert not is_cut(completion([5, 6, EOS], -1.0), round_tokens=3)  # EOS on its last allowed token
    assert not is_cut(completion([5, EOS], -1.0), round_tokens=3)


def test_the_second_round_feeds_the_prefix_back_or_the_prompt_alone():
    cut = completion([5, 6], -1.0)
    assert CUT_POLICIES["resume"].continuation_prompt([9, 8], cut) == [9, 8, 5, 6]
    assert CUT_POLICIES["drop"].continuation_prompt([9, 8], cut) == [9, 8]


def test_a_resumed_response_keeps_its_prefix_and_both_versions_logprobs():
    sample = CUT_POLICIES["resume"].joined(completion([5, 6], -1.0), completion([7, 8, 9], -2.0), max_tokens=4)
    assert sample.token_ids == [5, 6, 7, 8]  # truncated at the response limit
    assert sample.logprobs == [-1.0, -1.0, -2.0, -2.0]
    assert sample.prefix_length == 2


def test_a_dropped_response_is_all_the_newer_versions():
    sample = CUT_POLICIES["drop"].joined(completion([5, 6], -1.0), completion([7, EOS], -2.0), max_tokens=4)
    assert (sample.token_ids, sample.logprobs, sample.prefix_length) == ([7, EOS], [-2.0, -2.0], 2)


def test_the_rollout_needs_the_engines_logprobs():
    with pytest.raises(ValueError, match="logprobs=True"):
        complete(Completion([5], None, False), max_tokens=4)


def test_columns_pad_responses_and_logprobs():
    out = response_columns(
        [complete(completion([5, EOS], -1.0), max_tokens=4)], policy_version=3, max_response_length=4, pad_token_id=PAD
    )
    assert out["response_ids"].tolist() == [[5, EOS, PAD, PAD]]
    assert out["response_mask"].tolist() == [[1, 1, 0, 0]]
    assert out["sampled_logprobs"].tolist() == [[-1.0, -1.0, 0.0, 0.0]]
    assert out["policy_version"].tolist() == [3] and out["prefix_length"].tolist() == [2]


def test_old_logprobs_keep_the_sampling_versions_for_older_tokens():
    computed = torch.full((3, 4), -5.0)  # (B, SL) by the weights of version 2
    sampled = torch.tensor([[-1.0] * 4, [-1.0, -1.0, -5.0, -5.0], [-5.0] * 4])
    version = torch.tensor([1, 1, 2])  # whole by 1, cut at 2 tokens then 2, whole by 2
    prefix = torch.tensor([4, 2, 4])
    old = behaviour_logprobs(computed, sampled, version, prefix, current_version=2)
    assert old.tolist() == [[-1.0] * 4, [-1.0, -1.0, -5.0, -5.0], [-5.0] * 4]
    # on-policy (the pass runs with the sampling weights): the computed logprobs throughout
    assert torch.equal(
        behaviour_logprobs(computed, sampled, version, prefix, current_version=1)[:2],
        torch.tensor([[-5.0] * 4, [-5.0, -5.0, -5.0, -5.0]]),
    )


def run_rounds(mode: str, round_tokens: int | None):
    engine, dock = EngineDouble(), RecordingDock(prompts_of([9, 9], [8, 8], group=3))
    setup = RolloutSetup(
        rank=0,
        batch_size=6,
        spec=replace(ROLLOUT, consumes=("prompt_ids", "prompt_mask")),
        num_responses=3,
        max_response_length=6,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_prompts_per_iteration=2,
    )
    partial = PartialRollout(setup, policy=CUT_POLICIES[mode])
    first = partial.generate(engine, dock, RolloutRequest(iteration=1, policy_version=0, round_tokens=round_tokens))
    first.metrics["puts"] = len(dock.puts)  # what the first round wrote
    engine.version = 1  # the weight update between the rounds
    second = partial.finish(engine, dock, iteration=1, policy_version=1)
    return engine, dock, first, second


def rows_written(dock: RecordingDock) -> dict[int, tuple[list[int], list[float], int, int]]:
    """row -> (tokens, logprobs, policy_version, prefix_length) of everything put."""
    rows = {}
    for indices, out, version in dock.puts:
        assert out["policy_version"].eq(version).all()
        for i, row in enumerate(indices):
            length = int(out["response_mask"][i].sum())
            rows[row] = (
                out["response_ids"][i, :length].tolist(),
                out["sampled_logprobs"][i, :length].tolist(),
                version,
                int(out["prefix_length"][i]),
            )
    return rows


def test_without_a_budget_nothing_is_cut_and_the_second_round_has_nothing_to_do():
    engine, dock, first, second = run_rounds("resume", None)
    assert len(engine.calls) == 1 and first.metrics["partial_cut"] == 0 and second.metrics["partial_resumed"] == 0
    assert first.metrics["puts"] == 1 and second.num_samples == 0
    rows = rows_written(dock)
    assert sorted(rows) == list(range(6))
    assert rows[2] == ([7, 7, 7, EOS], [-1.0] * 4, 0, 4)


def test_resume_completes_cut_responses_from_their_prefix_under_the_new_weights():
    engine, dock, first, second = run_rounds("resume", 2)
    # responses 1 and 2 of both prompts ran past 2 tokens: the groups wait for the second round
    assert first.metrics["partial_cut"] == 4 and first.metrics["decode_steps"] == 0 and first.metrics["puts"] == 0
    call = engine.calls[1]
    assert call.prompts == [[9, 9, 7, 7]] * 2 + [[8, 8, 7, 7]] * 2 and call.n == 1 and call.max_tokens == 4
    assert second.metrics["partial_resumed"] == 4 and second.metrics["partial_carried_tokens"] == 8
    assert second.metrics["partial_dropped"] == 0 and second.num_samples == 6
    rows = rows_written(dock)
    assert sorted(rows) == list(range(6))
    assert rows[0] == ([7, EOS], [-1.0, -1.0], 0, 2)  # finished in the first round
    # prefix from version 0, continuation (the engine double's reply [7, EOS] to n=1) from version 1
    assert rows[1] == rows[2] == ([7, 7, 7, EOS], [-1.0, -1.0, -2.0, -2.0], 0, 2)


def test_drop_samples_cut_responses_again_from_the_prompt_under_the_new_weights():
    engine, dock, _, second = run_rounds("drop", 2)
    call = engine.calls[1]
    assert call.prompts == [[9, 9]] * 2 + [[8, 8]] * 2 and call.max_tokens == 6
    assert second.metrics["partial_dropped"] == 4 and second.metrics["partial_dropped_tokens"] == 8
    assert second.metrics["partial_resumed"] == 0 and second.metrics["partial_carried_tokens"] == 0
    rows = rows_written(dock)
    assert rows[0] == ([7, EOS], [-1.0, -1.0], 0, 2)  # kept, with its own version
    assert rows[1] == ([7, EOS], [-2.0, -2.0], 1, 2)  # sampled again, all by version 1
