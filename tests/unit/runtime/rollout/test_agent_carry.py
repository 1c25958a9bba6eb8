"""Carried episodes as a job's rollout (rollout/agent_carry.py): a rank's share of the prompts handed ahead,
the dock rows of a carried batch (each group's own prompt columns and admission version), and three
iterations of one rank on the episode loop with a scripted engine and a one-batch dock: the hand-ahead fills
the room, a group carried past a cut is written a version later into that iteration's rows with its own
prompt, and the last iteration admits nothing and drains."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_doubles import EOS, PAD, Gated, OneTokenEngine, RecordingDock, chat_char_tokenizer, gated_loop, prompts_of
from tensordict import TensorDict

from rldock.runtime.agent.episode_loop import AgentLoop, Episode
from rldock.runtime.agent.interfaces import EpisodeContext
from rldock.runtime.data import Row
from rldock.runtime.data.row_column import padded_rows, row_bytes, rows_from_column
from rldock.runtime.flow.columns import PROMPT_INDEX, PROMPT_ROW
from rldock.runtime.flow.states import ROLLOUT
from rldock.runtime.rollout.agent_carry import CarriedAgentRollout, ahead_share, carried_rows
from rldock.runtime.rollout.agent_episodes import episode_columns
from rldock.runtime.rollout.carry import CarriedGroup
from rldock.runtime.rollout.protocol import RolloutRequest, RolloutSetup


def train_rows(*indices: int) -> torch.Tensor:
    """The dock's `prompt_row` of train rows `indices`: row i's answer is str(i)."""
    encoded = [row_bytes(Row(f"prompt {i}", str(i), "test")) for i in indices]
    return torch.frombuffer(padded_rows(encoded, 256), dtype=torch.uint8).view(len(indices), 256)


def prompt_rows(*indices: int) -> TensorDict:
    """One row per group: prompt ids [9, index + 3] left-padded to 3, its `prompt_index` and train row."""
    ids = torch.tensor([[PAD, 9, i + 3] for i in indices])  # (k, 3)
    return TensorDict(
        {
            "prompt_ids": ids,
            "prompt_mask": (ids != PAD).long(),
            "prompt_index": torch.tensor(indices),
            "prompt_row": train_rows(*indices),
        },
        batch_size=[len(indices)],
    )


def test_each_replica_takes_its_groups_of_every_batch_handed_ahead():
    ahead = prompt_rows(*range(8))  # two batches of G = 4, two replicas of B = 2
    share, numbers = ahead_share(ahead, replica=1, num_groups=2, groups_per_batch=4)
    assert numbers.tolist() == [2, 3, 6, 7]
    assert share["prompt_index"].tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="shares of 3"):
        ahead_share(ahead, replica=0, num_groups=3, groups_per_batch=4)


def test_a_carried_batch_writes_each_group_with_its_own_prompt_and_admission_version():
    prompts = prompt_rows(5, 7, 9)
    written = [
        CarriedGroup((Episode([1], 2 * i, None), Episode([1], 2 * i + 1, None)), version, version + 1, i, prompts[i])
        for i, version in enumerate([1, 0, 1])
    ]
    responses = episode_columns(
        [e for g in written for e in g.episodes], max_response_length=4, max_turns=2, pad_token_id=PAD, policy_version=1
    )
    rows = torch.arange(10, 16)  # the rank's rows of this iteration's bank
    writes = list(carried_rows(written, rows, responses, group=2))
    assert [(version, rows.tolist()) for version, rows, _ in writes] == [(0, [12, 13]), (1, [10, 11, 14, 15])]
    (_, _, old), (_, _, new) = writes
    assert old["prompt_index"].tolist() == [7, 7] and old["policy_version"].tolist() == [0, 0]
    assert old["prompt_ids"].tolist() == [[PAD, 9, 10]] * 2
    assert new["prompt_index"].tolist() == [5, 5, 9, 9] and new["policy_version"].tolist() == [1] * 4
    assert set(new.keys()) == set(responses.keys()) | {"prompt_ids", "prompt_mask", "prompt_index", "prompt_row"}
    assert [row.ground_truth for row in rows_from_column(new["prompt_row"])] == ["5", "5", "9", "9"]


class SamplerDouble:
    """Test double of AgentSampler: one episode loop; a row's context is its answer (its prompt_index), the
    gate its episodes wait for."""

    def __init__(self, loop: AgentLoop):
        self.loop, self.spec = loop, loop.spec

    def loop_on(self, engine) -> AgentLoop:
        return self.loop

    def context(self, row: Row) -> EpisodeContext:
        return EpisodeContext(row.ground_truth, "test")


@pytest.fixture(scope="module")
def tokenizer():
    return chat_char_tokenizer()


def test_a_rank_fills_its_room_from_the_hand_ahead_and_writes_carried_groups_later_with_their_prompts(tokenizer):
    engine, environment = OneTokenEngine(), Gated()
    loop = gated_loop(tokenizer, engine, environment)
    setup = RolloutSetup(
        rank=0,
        batch_size=2,  # one group of N = 2 per batch
        spec=replace(ROLLOUT, consumes=ROLLOUT.consumes + PROMPT_INDEX + PROMPT_ROW),
        num_responses=2,
        max_response_length=64,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_prompts_per_iteration=1,
    )
    rollout = CarriedAgentRollout(setup, SamplerDouble(loop), max_staleness=1, iterations=3, replica=0, seed=0)  # type: ignore[arg-type]

    def bank(prompt_index: int) -> RecordingDock:
        dock = RecordingDock(prompts_of([9, prompt_index + 3], group=2))
        dock.batch["prompt_index"] = torch.full((2,), prompt_index)
        dock.batch["prompt_row"] = train_rows(prompt_index, prompt_index)
        return dock

    def opened(name: int) -> None:
        loop._loop.call_soon_threadsafe(environment.gate(str(name)).set)

    counts, written = [], []
    try:
        # iteration 1: the bank brings prompt 0, the driver hands prompt 1 ahead; group 1 finishes first
        dock = bank(0)
        opened(1)
        result = rollout.generate(engine, dock, RolloutRequest(iteration=1, policy_version=0, ahead=prompt_rows(1)))
        counts.append(result.metrics)
        written.append(dock.written())
        # iteration 2 (version 1): prompt 2 admitted, group 0 is due: written now, a version old
        engine.weights = 1
        dock = bank(2)
        opened(0)
        result = rollout.generate(engine, dock, RolloutRequest(iteration=2, policy_version=1))
        counts.append(result.metrics)
        written.append(dock.written())
        # iteration 3, the last: nothing admitted, group 2 drains
        dock = bank(7)
        opened(2)
        result = rollout.generate(engine, dock, RolloutRequest(iteration=3, policy_version=2))
        counts.append(result.metrics)
        written.append(dock.written())
        assert [put[2] for put in dock.puts] == [1]  # tagged with its admission's version
    finally:
        assert rollout.carried is not None
        rollout.carried.abandon()
        loop.close()
    assert [(c["carry_admitted"], c["carry_written"], c["carry_open"]) for c in counts] == [
        (4, 2, 2),
        (2, 2, 2),
        (0, 2, 0),
    ]
    # each iteration's rows hold the group written then, with its own prompt, not the bank's
    assert [w["prompt_index"].tolist() for w in written] == [[1, 1], [0, 0], [2, 2]]
    assert [w["prompt_ids"][:, -1].tolist() for w in written] == [[4, 4], [3, 3], [5, 5]]
    assert [w["policy_version"].tolist() for w in written] == [[0, 0], [0, 0], [1, 1]]
    # group 0's first turn sampled before the update, its second after it
    carried_versions = written[1]["token_policy_version"][0]
    assert {0, 1} <= set(carried_versions.tolist())
    assert environment.closed == 6 and loop.sessions_open == 0
