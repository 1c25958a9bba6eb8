"""Carried episodes (rollout/carry.py): the cut that fills a batch with finished groups within the
staleness bound, checked as a table and over random heavy-tailed finishing orders, and the groups run on
the episode loop with a scripted engine: a carried group's session stays open across the update, its
next turn is sampled on the new weights, and every group admitted is written once."""

from __future__ import annotations

import random

import pytest
from rollout_doubles import Gated, OneTokenEngine, chat_char_tokenizer, gated_loop

from rldock.runtime.agent.episode_loop import Episode
from rldock.runtime.agent.interfaces import EpisodeContext
from rldock.runtime.rollout.carry import (
    CarriedEpisodes,
    CarriedGroup,
    admission_room,
    admits_fresh,
    batch_of,
    batches_ahead,
)


def group(deadline: int, *, finished: bool, order: int = 0, size: int = 2) -> CarriedGroup:
    episodes = tuple(Episode([1], key, None, finished=finished) for key in range(size))
    return CarriedGroup(episodes, version=deadline - 1, deadline=deadline, order=order)


@pytest.mark.parametrize(
    ("groups", "version", "num_groups", "expected"),
    [
        # too few finished to fill the batch
        ([(1, True), (1, False)], 0, 2, None),
        # nothing due yet: the last admitted finished groups go first
        ([(1, True), (1, True), (2, True)], 0, 2, [2, 1]),
        # a group due now is waited for, however many others finished
        ([(0, False), (1, True), (1, True)], 0, 2, None),
        ([(0, True), (1, True), (1, True)], 0, 2, [0, 2]),
        # B = 1 at version 1: two groups due by 2 and a later one finished. Taking it would leave two
        # groups due at 2 for the one batch left by then: the batch waits for an earlier one.
        ([(2, False), (2, False), (3, True)], 1, 1, None),
        ([(2, True), (2, False), (3, True)], 1, 1, [0]),
        # one group due by 2 and one batch left by then: the later group may go now
        ([(2, True), (3, True)], 1, 1, [1]),
    ],
)
def test_the_batch_takes_what_the_bound_needs_then_the_freshest_finished_groups(groups, version, num_groups, expected):
    made = [group(deadline, finished=finished, order=i) for i, (deadline, finished) in enumerate(groups)]
    chosen = batch_of(made, version=version, num_groups=num_groups)
    assert (None if chosen is None else [made.index(g) for g in chosen]) == expected


def test_admission_keeps_at_most_the_next_bound_plus_one_batches_open():
    assert admission_room(0, num_groups=4, max_staleness=0) == 4
    assert admission_room(5, num_groups=4, max_staleness=1) == 3
    assert admission_room(9, num_groups=4, max_staleness=1) == 0


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("iterations", [1, 2, 5])
def test_a_rank_admits_as_many_batches_as_it_writes_from_whichever_iteration_it_starts(max_staleness, iterations):
    for start in range(1, iterations + 1):  # a run, or an attempt resumed at `start`
        open_batches = admitted = 0
        for iteration in range(start, iterations + 1):
            first = iteration == start
            new = int(admits_fresh(iteration, first=first, iterations=iterations, max_staleness=max_staleness))
            if first:
                new += batches_ahead(iteration, iterations=iterations, max_staleness=max_staleness)
            open_batches += new
            admitted += new
            assert 1 <= open_batches <= max_staleness + 1, (start, iteration)  # a batch to write, within the room
            open_batches -= 1  # the iteration writes one
        assert admitted == iterations - start + 1 and open_batches == 0


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 3])
@pytest.mark.parametrize("num_groups", [1, 3])
def test_random_heavy_tailed_finishes_never_exceed_the_bound_nor_drop_a_group(max_staleness, num_groups):
    """Groups take 1-10x each other to finish; each batch lets them finish in time order until the cut
    holds. Every group admitted is written once, within the bound, and the cut is always reached."""
    rng = random.Random(max_staleness * 10 + num_groups)
    open_groups: list[CarriedGroup] = []
    finish_at: dict[int, float] = {}
    clock, admitted, written = 0.0, 0, []
    for version in range(60):
        for _ in range(admission_room(len(open_groups), num_groups=num_groups, max_staleness=max_staleness)):
            made = group(version + max_staleness, finished=False, order=admitted)
            made = CarriedGroup(made.episodes, version, version + max_staleness, admitted)
            finish_at[admitted] = clock + rng.uniform(1.0, 10.0)
            open_groups.append(made)
            admitted += 1
        while (batch := batch_of(open_groups, version=version, num_groups=num_groups)) is None:
            pending = [g for g in open_groups if not g.finished]
            assert pending, "every open group finished and still no batch"
            first = min(pending, key=lambda g: finish_at[g.order])
            clock = max(clock, finish_at[first.order])
            for episode in first.episodes:
                episode.finished = True
        assert len(batch) == num_groups
        assert all(0 <= version - g.version <= max_staleness for g in batch)
        written += [g.order for g in batch]
        open_groups = [g for g in open_groups if g not in batch]
    assert sorted(written + [g.order for g in open_groups]) == list(range(admitted))


# --- on the episode loop ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return chat_char_tokenizer()


def test_a_carried_group_stays_open_across_the_update_and_finishes_on_the_new_weights(tokenizer):
    engine, environment = OneTokenEngine(), Gated()
    loop = gated_loop(tokenizer, engine, environment)
    prompt = tokenizer("<user>hi<eos>", add_special_tokens=False)["input_ids"]
    carried = CarriedEpisodes(loop, num_groups=1, max_staleness=1, seed=0)

    def admit(names: list[str], version: int) -> None:
        carried.admit(
            [prompt] * len(names),
            keys=[[int(name) * 2, int(name) * 2 + 1] for name in names],
            contexts=[EpisodeContext(name, "test") for name in names],
            version=version,
        )

    def opened(name: str) -> None:
        loop._loop.call_soon_threadsafe(environment.gate(name).set)

    try:
        assert carried.room == 2
        admit(["0", "1"], version=0)
        opened("1")
        (first,) = carried.next_batch(version=0)  # group 1 finished; group 0's first steps still out
        assert first.episodes[0].context.ground_truth == "1"
        assert loop.sessions_open == 2 and environment.closed == 2  # group 0's sessions held across
        engine.weights = 1
        admit(["2"], version=1)
        opened("0")
        opened("2")
        (second,) = carried.next_batch(version=1)  # group 0 is due at 1: written before group 2
        assert second.episodes[0].context.ground_truth == "0"
        # its first turn sampled by version 0 before the update, its second by version 1 after it
        model_versions = [v for v, m in zip(second.episodes[0].token_version, second.episodes[0].model_mask) if m]
        assert model_versions == [0, 0, 1, 1]
        assert second.episodes[0].logprobs[-1] == -2.0
        (third,) = carried.next_batch(version=2)
        assert third.episodes[0].context.ground_truth == "2"
    finally:
        carried.abandon()
        loop.close()
    assert carried.counts.started == carried.counts.written == 6 and carried.groups == []
    assert dict(carried.counts.staleness) == {0: 1, 1: 2}
    assert environment.closed == 6 and loop.sessions_open == 0
