"""The prompt ledger (driver/prompt_ledger.py) and the feed's draw numbers and requeue (driver/feed.py): every group
a run draws ends trained once, passed over once, or open at its end, also across a stop and a resume."""

from __future__ import annotations

import json

import pytest
import torch

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime.data import Row
from rldock.runtime.data.row_column import row_bytes
from rldock.runtime.data.sampler import PromptSampler
from rldock.runtime.driver.feed import Feed
from rldock.runtime.driver.prompt_ledger import LEDGER_FILE, PromptLedger

NUM_PROMPTS, G, N = 5, 2, 3


class CountingDataset:
    """Prompt `p` is the tokens [2, 3 + p]; its train row is 100 + p, whose answer is p."""

    row_width = 512  # more than any of its rows pickled

    def prompt_ids(self, positions):
        return [[2, 3 + p] for p in positions]

    def prompt_index(self, position):
        return 100 + position

    def encoded_rows(self, positions):
        return [row_bytes(Row(f"prompt {p}", str(p), "counting")) for p in positions]


class PadTokenizer:
    pad_token_id = 0


def feed(seed: int = 1) -> Feed:
    algo = AlgorithmSpec(
        name="grpo",
        num_prompts_per_iteration=G,
        num_responses_per_prompt=N,
        max_prompt_length=4,
        max_response_length=4,
        learning_rate=0.0,
    )
    return Feed(CountingDataset(), PromptSampler(NUM_PROMPTS, seed=seed), PadTokenizer(), algo, "prompt_groups")


def groups(batch) -> list[tuple[int, int]]:
    """(draw number, train row) of each group of a (G*N,) batch, one per group."""
    return list(zip(batch["prompt_draw"][::N].tolist(), batch["prompt_index"][::N].tolist()))


def test_each_row_carries_its_groups_draw_number_across_epochs():
    f, sampler = feed(), PromptSampler(NUM_PROMPTS, seed=1)
    order = sampler.next_batch(3 * G)  # the sampler's own order, over an epoch's end (5 prompts)
    drawn = [groups(f.draw().batch) for _ in range(3)]
    assert [d for batch in drawn for d, _ in batch] == list(range(3 * G))
    assert [row for batch in drawn for _, row in batch] == [100 + p for p in order]
    assert f.draw().batch["prompt_draw"].tolist() == [6, 6, 6, 7, 7, 7]  # N rows of each group
    assert f.drawn == 8 and [f.sampler.prompt_of(d) for d in range(6)] == order


def test_requeued_groups_are_drawn_first_with_their_own_prompt_and_number():
    f = feed()
    first = [groups(f.draw().batch) for _ in range(3)]
    again = feed()
    again.load_state_dict(f.state_dict())
    again.requeue([3, 1, 4])
    out = groups(again.draw().batch) + groups(again.draw().batch)
    by_draw = {d: row for batch in first for d, row in batch}
    assert out[:3] == [(1, by_draw[1]), (3, by_draw[3]), (4, by_draw[4])]  # in draw order, the same prompts
    assert out[3][0] == 6 and again.requeued == []  # then new draws, numbered on from the position
    assert again.draw(0).batch.batch_size == torch.Size([0])


def test_a_sync_iteration_trains_its_groups_or_passes_them_over():
    ledger = PromptLedger()
    # 2 groups put, the staleness bound dropped every sample of group 1: passed over, not open
    assert ledger.settle(1, read=[0], put=[0, 0, 1, 1], drawn=4) == {
        "prompts/trained_groups": 1,
        "prompts/passed_over_groups": 1,
        "prompts/open_groups": 2,  # groups 2 and 3, drawn ahead for the next iteration
        "prompts/trained_twice": 0,
    }
    assert ledger.open_below(4) == [2, 3]
    ledger.settle(2, read=[2, 3], put=[2, 3], drawn=4)
    assert ledger.summary(4) == {"drawn": 4, "trained": 3, "passed_over": 1, "open": 0, "trained_twice": 0}


def test_held_groups_train_where_they_are_read_and_a_second_training_is_counted():
    ledger = PromptLedger()
    counts = ledger.settle(1, read=[0, 1], put=None, drawn=6)  # a carry job: ranks hold groups 2-5
    assert (counts["prompts/trained_groups"], counts["prompts/passed_over_groups"]) == (2, 0)
    assert counts["prompts/open_groups"] == 4
    assert ledger.settle(2, read=[1, 2], put=None, drawn=6)["prompts/trained_twice"] == 1
    assert ledger.trained_twice == [1] and ledger.trained[1] == 1


def test_the_ledger_survives_its_checkpoint_file(tmp_path):
    ledger = PromptLedger(since=2)
    ledger.settle(1, read=[2, 3], put=[2, 3, 4], drawn=7)
    ledger.settle(2, read=[5], put=None, drawn=7)
    ledger.save(tmp_path, drawn=7)
    saved = json.loads((tmp_path / LEDGER_FILE).read_text())
    assert saved["summary"] == {"drawn": 5, "trained": 3, "passed_over": 1, "open": 1, "trained_twice": 0}
    assert saved["trained"] == {"1": [2, 3], "2": [5]} and saved["passed_over"] == {"1": [4]}
    loaded = PromptLedger.load(tmp_path, drawn=7)
    assert (loaded.since, loaded.trained, loaded.passed_over) == (2, ledger.trained, ledger.passed_over)
    assert loaded.open_below(7) == [6]
    assert PromptLedger.load(tmp_path / "older", drawn=9).since == 9  # a checkpoint saved before ledgers


def run_carry(f: Feed, ledger: PromptLedger, iterations: range, *, last: int, stop_after: int | None = None) -> dict:
    """A carry job's iterations (rollout/agent_carry.py reduced to its prompt groups) on `f` and `ledger`: an
    attempt's first iteration draws its own batch and hands a second ahead, which fills the ranks' room of
    two batches; each iteration admits the batch it draws (but the run's `last`, which has no room left to
    write it) and trains the oldest batch held. Returns what a checkpoint at `stop_after` (where the run
    stops) or at the end holds."""
    held: list[int] = []
    for iteration in iterations:
        fed = f.draw(2 * G if iteration == iterations.start and iteration < last else G).batch
        if iteration < last:
            held += [d for d, _ in groups(fed)]
        trained, held = held[:G], held[G:]
        ledger.settle(iteration, read=trained, put=None, drawn=f.drawn)
        if iteration == stop_after:
            break
    return {"trained": dict(ledger.trained), "drawn": f.drawn, "sampler": f.state_dict()}


@pytest.mark.parametrize("requeue", [True, False])
def test_a_resumed_carry_job_trains_the_groups_its_ranks_held_once(requeue):
    """The groups the ranks held at the checkpoint are drawn again by the resumed run (requeue), which then
    trains every group the uninterrupted run trains, each once; without the requeue they are lost."""
    whole = run_carry(feed(), PromptLedger(), range(1, 5), last=4)
    assert sorted(whole["trained"]) == list(range(4 * G))

    stopped_feed, stopped_ledger = feed(), PromptLedger()
    at_stop = run_carry(stopped_feed, stopped_ledger, range(1, 5), last=4, stop_after=2)
    assert stopped_ledger.open_below(at_stop["drawn"]) == [4, 5]  # the batch the ranks held

    resumed, ledger = feed(), PromptLedger()
    resumed.load_state_dict(at_stop["sampler"])
    ledger.trained = dict(at_stop["trained"])
    if requeue:
        resumed.requeue(ledger.open_below(resumed.drawn))
    end = run_carry(resumed, ledger, range(3, 5), last=4)
    assert ledger.trained_twice == []
    if requeue:
        assert sorted(end["trained"]) == sorted(whole["trained"])
    else:
        assert not {4, 5} & set(end["trained"]) and ledger.open_below(end["drawn"])[:2] == [4, 5]


def test_an_attempt_draws_the_groups_its_checkpoint_left_open_again(tmp_path):
    """Trainer._resume_position: a retry with no checkpoint yet draws every group the failed attempt drew
    again, in order; one from a checkpoint takes its position and ledger and draws again what it holds open."""
    from types import SimpleNamespace

    from rldock.runtime import checkpoint as ckpt
    from rldock.runtime.driver.records import MetricsLog
    from rldock.runtime.driver.trainer import Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.metrics, trainer.inputs, trainer.resume_from = MetricsLog(tmp_path), SimpleNamespace(feed=feed()), None
    first = [groups(trainer.inputs.feed.draw().batch) for _ in range(2)]  # the failed attempt's two iterations
    assert trainer._resume_position() == 1
    assert trainer.inputs.feed.requeued == [0, 1, 2, 3]
    assert [groups(trainer.inputs.feed.draw().batch) for _ in range(2)] == first  # the same prompts again

    ledger = PromptLedger()
    ledger.settle(1, read=[0, 1], put=None, drawn=4)  # a carry job's iteration 1: groups 2 and 3 held
    staging = ckpt.staging_dir(tmp_path, 1)
    ledger.save(staging, drawn=4)
    sampler = PromptSampler(NUM_PROMPTS, seed=1)
    sampler.next_batch(4)
    trainer.resume_from = ckpt.commit(tmp_path, staging, 1, {"sampler": sampler.state_dict()}, keep_last=1)
    assert trainer._resume_position() == 2
    assert (trainer.inputs.feed.drawn, trainer.inputs.feed.requeued) == (4, [2, 3])
    assert trainer.ledger.trained == {0: 1, 1: 1}
