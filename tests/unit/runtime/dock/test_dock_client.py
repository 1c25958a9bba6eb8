"""TransferDock end to end on one local Ray session, in both dock modes (the distributed one with
its warehouses inside the controller host, as by default on one node, and as actors of their
own): round trips, hand-out rules, counters, balanced hand-out, state snapshots, and failing fast
when a dock actor dies."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray
import torch
from ray import cloudpickle
from tensordict import TensorDict

from rldock.config.job import DockSpec
from rldock.runtime.dock import DockActorDiedError, DockTimeoutError, TransferDock
from rldock.runtime.dock.balance import balance_by_tokens

PL, SL = 5, 6  # prompt and response lengths of the test batches
NUM_SAMPLES, GROUP_SIZE = 16, 4
STATES = {
    "reference": ["prompt_ids", "response_ids"],
    "update": ["prompt_ids", "response_ids", "old_logprobs", "reward"],
    "bf16": ["half_logprobs"],
    "balanced": ["response_mask"],
}
TOKEN_COLUMNS = ["response_mask"]
COLUMNS = ("prompt_ids", "response_ids", "old_logprobs", "reward")
ALL = list(range(NUM_SAMPLES))


@pytest.fixture(scope="module", autouse=True)
def ray_session(start_local_ray) -> Iterator[None]:
    # Worker processes cannot import this test module: ship its functions by value instead.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with start_local_ray(num_cpus=8, resources={"NPU": 8}):
        yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


# Each kind of dock: its DockSpec fields and TransferDock.create's switches (which a job sets from
# JobConfig.ablations). `distributed` (the default) on one node: every row moves through shared
# memory, the calls carry metadata only. `host-reads` keeps rows out of shared memory
# (shared_memory off), so the controller host sends and stores them in its calls.
# `warehouse-actors` has every warehouse an actor of its own, reached by Ray calls (also
# colocate_controllers off): the path of a warehouse on another node than the worker, which a
# one-node session otherwise never takes.
KINDS = {
    "distributed": ({}, {}),
    "host-reads": ({}, {"shared_memory": False}),
    "warehouse-actors": ({}, {"colocate_controllers": False, "shared_memory": False}),
    "central": ({"mode": "central"}, {}),
}


@pytest.fixture(scope="module", params=list(KINDS))
def kind(request: pytest.FixtureRequest) -> str:
    """Every test that uses a dock runs on every kind (pytest groups the tests by kind)."""
    return request.param


def spec_of(kind: str, **fields) -> DockSpec:
    return DockSpec(**KINDS[kind][0], **fields)


def make_dock(spec: DockSpec, kind: str = "distributed", **switches: bool) -> TransferDock:
    return TransferDock.create(
        spec,
        states=STATES,
        num_samples=NUM_SAMPLES,
        group_size=GROUP_SIZE,
        token_columns=TOKEN_COLUMNS,
        **{**KINDS[kind][1], **switches},
    )


@pytest.fixture(scope="module")
def dock1(ray_session: None, kind: str) -> Iterator[TransferDock]:
    """The default spec on a one-node session: one warehouse (or the central buffer)."""
    dock = make_dock(spec_of(kind, timeout_s=0.5), kind)
    yield dock
    dock.shutdown()


@pytest.fixture(scope="module")
def dock2(ray_session: None, kind: str) -> Iterator[TransferDock]:
    """Two warehouses of 2 groups each (central: the one buffer). Shared by the tests (actor
    start-up costs seconds here)."""
    spec = spec_of(kind, timeout_s=0.5) if kind == "central" else spec_of(kind, num_warehouses=2, timeout_s=0.5)
    dock = make_dock(spec, kind)
    yield dock
    dock.shutdown()


@pytest.fixture
def dock(dock2: TransferDock) -> TransferDock:
    """The shared dock at the start of a fresh iteration."""
    dock2.reset()
    return dock2


def samples(indices: list[int], columns: tuple[str, ...] = COLUMNS) -> TensorDict:
    """Columns whose values encode the sample index, so any mix-up shows."""
    index = torch.tensor(indices)
    data = {
        "prompt_ids": index[:, None] * 100 + torch.arange(PL),  # (B, PL) int64
        "response_ids": index[:, None] * 1000 + torch.arange(SL),  # (B, SL) int64
        "old_logprobs": -index[:, None].float() - torch.arange(SL) / 10,  # (B, SL) float32
        "reward": index.float() / 100,  # (B,) float32
    }
    return TensorDict({name: data[name] for name in columns}, batch_size=[len(indices)])


def assert_matches(indices: torch.Tensor, batch: TensorDict) -> None:
    expected = samples(indices.tolist(), tuple(batch.keys()))
    for name in batch.keys():
        assert batch[name].dtype == expected[name].dtype
        assert torch.equal(batch[name], expected[name]), name


def counters(dock: TransferDock) -> dict[str, int]:
    """Warehouse counters summed over warehouses, plus the reference controller's."""
    stats = dock.stats()
    summed = {
        key: sum(w[key] for w in stats["warehouses"])
        for key in ("bytes_in", "bytes_out", "write_requests", "read_requests")
    }
    reference = stats["controllers"]["reference"]
    for key in ("requests", "samples_handed_out", "mark_ready_calls"):
        summed[f"reference_{key}"] = reference[key]
    return summed


@pytest.mark.parametrize("num_warehouses", [1, 2])
def test_put_get_round_trip(dock1: TransferDock, dock: TransferDock, num_warehouses: int) -> None:
    if num_warehouses == 1:
        dock1.reset()
        dock = dock1
    assert dock.layout.num_warehouses == (num_warehouses if dock.mode == "distributed" else 1)
    order = [13, 2, 7, 0, 15, 4, 9, 11, 1, 3, 5, 6, 8, 10, 12, 14]
    dock.put(torch.tensor(order[:8]), samples(order[:8]))
    dock.put(torch.tensor(order[8:]), samples(order[8:]))
    before = counters(dock)
    got = dock.get("update", ["reward", "old_logprobs", "prompt_ids", "response_ids"], batch_size=16)
    assert got is not None
    indices, batch = got
    assert indices.tolist() == ALL  # ascending, across both warehouses
    assert batch.batch_size == torch.Size([16])
    assert_matches(indices, batch)
    assert counters(dock)["read_requests"] - before["read_requests"] == dock.layout.num_warehouses


def test_put_and_get_writes_then_hands_out_as_put_then_get_would(dock: TransferDock) -> None:
    """A stage's write and its next request in one call: the rows are ready for every state when it
    answers, the grant is the one `get` would give, and the controllers heard one call for both."""
    dock.put(torch.arange(8), samples(list(range(8)), ("prompt_ids", "response_ids")))
    indices, batch = dock.get("reference", ["prompt_ids", "response_ids"], batch_size=4)
    before = counters(dock)
    reference_out = samples(indices.tolist(), ("old_logprobs", "reward"))
    got = dock.put_and_get(indices, reference_out, "reference", ["prompt_ids", "response_ids"], batch_size=4)
    assert got is not None
    assert got[0].tolist() == [i for i in range(8) if i not in indices.tolist()][:4]
    assert_matches(*got)
    after = counters(dock)
    assert after["reference_requests"] - before["reference_requests"] == 1
    assert after["reference_mark_ready_calls"] - before["reference_mark_ready_calls"] == 0  # not its columns
    # The update (which needs all four columns) sees the written rows: the write came first.
    update = dock.get("update", list(COLUMNS), batch_size=4)
    assert update is not None and update[0].tolist() == indices.tolist()
    assert_matches(*update)
    # Once every sample was handed out, the write still lands and the answer is "exhausted".
    dock.put(torch.arange(8, 16), samples(list(range(8, 16)), ("prompt_ids", "response_ids")))
    assert dock.get("reference", ["prompt_ids"], batch_size=8) is not None
    last = dock.put_and_get(
        got[0], samples(got[0].tolist(), ("old_logprobs", "reward")), "reference", ["prompt_ids"], batch_size=4
    )
    assert last is None and dock.drained
    assert dock.get("update", list(COLUMNS), batch_size=4)[0].tolist() == got[0].tolist()


def test_default_spec_is_one_warehouse_per_node(dock1: TransferDock, kind: str) -> None:
    assert dock1.mode == spec_of(kind).mode
    assert dock1.layout.num_warehouses == 1
    assert dock1.warehouse_nodes() == [ray.get_runtime_context().get_node_id()]


def test_bfloat16_column_round_trips(dock: TransferDock) -> None:
    values = torch.randn(NUM_SAMPLES, SL).to(torch.bfloat16)
    dock.put(torch.arange(NUM_SAMPLES), TensorDict({"half_logprobs": values}, batch_size=[NUM_SAMPLES]))
    indices, got = dock.get("bf16", ["half_logprobs"], batch_size=NUM_SAMPLES)
    assert got["half_logprobs"].dtype == torch.bfloat16 and torch.equal(got["half_logprobs"], values)


def test_the_docks_actors_move_columns_without_importing_torch(dock: TransferDock) -> None:
    """The dtype travels by name (dock/wire.py): after every kind of write and read, also of a column
    numpy has no dtype for, the controller host and the warehouses have not loaded torch (about 1.9 CPU
    seconds of each one's start). This module's one task, `consume`, runs in a runtime env of its own,
    so no worker it loaded torch into is handed to a dock actor: each dock actor's process is its own."""
    values = torch.randn(NUM_SAMPLES, SL).to(torch.bfloat16)
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL).update({"half_logprobs": values}))
    assert dock.get("update", list(COLUMNS), batch_size=NUM_SAMPLES) is not None
    assert dock.get("bf16", ["half_logprobs"], batch_size=NUM_SAMPLES) is not None
    loaded = ray.get([actor.__ray_call__.remote(lambda _: "torch" in sys.modules) for actor in dock.actors()])
    assert loaded == [False] * len(dock.actors())


def take_all(dock: TransferDock, state: str, rank: int, batch_size: int) -> list[int]:
    """A consumer rank: takes batches until the state is exhausted."""
    taken: list[int] = []
    while True:
        got = dock.get(state, ["prompt_ids", "response_ids"], rank=rank, batch_size=batch_size, timeout_s=60)
        if got is None:
            return taken
        indices, batch = got
        assert_matches(indices, batch)
        taken.extend(indices.tolist())


# A runtime env of its own: Ray pools idle workers by runtime env, so the task's workers (torch loaded)
# are never handed to a dock actor, which starts in the job's default env
# (test_the_docks_actors_move_columns_without_importing_torch). max_calls=1 did the same at the cost of a
# fresh worker per call: 5-6 s against 0.3 s for each kind's call here.
consume = ray.remote(num_cpus=1, runtime_env={"env_vars": {"RLDOCK_TEST_DOCK_CONSUMER": "1"}})(take_all)


def test_two_ranks_get_disjoint_samples_exactly_once(dock: TransferDock) -> None:
    # Rank 0 is a Ray task (the dock travels pickled, as into a worker actor); rank 1 a driver thread.
    rank0 = consume.remote(dock, "reference", 0, 3)
    with ThreadPoolExecutor(max_workers=1) as pool:
        rank1 = pool.submit(take_all, dock, "reference", 1, 3)
        for start in range(0, NUM_SAMPLES, 4):  # the producer writes while both ranks wait
            time.sleep(0.05)
            dock.put(torch.arange(start, start + 4), samples(list(range(start, start + 4))))
        taken1 = rank1.result(timeout=120)
    taken0 = ray.get(rank0, timeout=120)
    assert sorted(taken0 + taken1) == ALL
    assert dock.stats()["controllers"]["reference"]["handed_out_now"] == NUM_SAMPLES


def test_whole_groups_are_not_handed_out_partially(dock: TransferDock) -> None:
    dock.put(torch.tensor([0, 1, 2, 4, 5, 6, 7, 9]), samples([0, 1, 2, 4, 5, 6, 7, 9]))  # groups of 4
    indices, _ = dock.get("reference", ["prompt_ids"], batch_size=4, whole_groups=True)
    assert indices.tolist() == [4, 5, 6, 7]
    with pytest.raises(DockTimeoutError, match="0 complete groups"):
        dock.get("reference", ["prompt_ids"], batch_size=4, whole_groups=True, timeout_s=0.2)
    with pytest.raises(ValueError, match="multiple of the group size 4"):
        dock.get("reference", ["prompt_ids"], batch_size=6, whole_groups=True)
    dock.put(torch.tensor([3, 8, 10, 11]), samples([3, 8, 10, 11]))
    indices, _ = dock.get("reference", ["prompt_ids"], batch_size=8, whole_groups=True)
    assert indices.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]


def test_consumer_gets_nothing_until_its_column_is_written(dock: TransferDock) -> None:
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL, ("prompt_ids", "response_ids")))
    assert dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES) is not None
    with pytest.raises(DockTimeoutError, match="'old_logprobs': 16"):
        dock.get("update", ["reward"], batch_size=NUM_SAMPLES, timeout_s=0.2)
    with ThreadPoolExecutor(max_workers=1) as pool:
        waiting = pool.submit(dock.get, "update", ["reward", "prompt_ids"], batch_size=NUM_SAMPLES, timeout_s=60)
        time.sleep(0.3)
        assert not waiting.done()
        dock.put(torch.arange(NUM_SAMPLES), samples(ALL, ("old_logprobs", "reward")))
        indices, batch = waiting.result(timeout=60)
    assert indices.tolist() == ALL
    assert_matches(indices, batch)


def test_exhausted_state_returns_none(dock: TransferDock) -> None:
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
    first = dock.get("reference", ["prompt_ids"], batch_size=10)
    second = dock.get("reference", ["prompt_ids"], batch_size=10)
    assert first is not None and second is not None
    assert (first[0].tolist(), second[0].tolist()) == (ALL[:10], ALL[10:])
    assert dock.get("reference", ["prompt_ids"], batch_size=10) is None
    assert dock.get("update", ["reward"], batch_size=NUM_SAMPLES) is not None  # states are independent


def test_timeout_raises_quickly_with_a_helpful_message(dock: TransferDock) -> None:
    dock.put(torch.arange(4), samples(list(range(4)), ("prompt_ids",)))
    started = time.monotonic()
    with pytest.raises(DockTimeoutError) as caught:
        dock.get("reference", ["prompt_ids", "response_ids"], rank=1, batch_size=4)  # spec timeout: 0.5 s
    assert time.monotonic() - started < 5
    message = str(caught.value)
    for part in [
        "'reference'",
        "rank 1",
        "response_ids",
        "waited 0.5s",
        "16 samples remaining",
        "0 are ready",
        "16 are not",
        "'prompt_ids': 12",
        "'response_ids': 16",
    ]:
        assert part in message, message
    assert "Traceback" not in message and "ray::" not in message  # unwrapped from RayTaskError


def test_counters_count_bytes_and_requests(dock: TransferDock) -> None:
    before = counters(dock)
    written = samples(ALL)
    dock.put(torch.arange(NUM_SAMPLES), written)
    assert dock.get("reference", ["prompt_ids", "response_ids"], batch_size=6) is not None
    assert dock.get("reference", ["response_ids"], batch_size=6) is not None
    after = counters(dock)
    change = {key: after[key] - before[key] for key in after}
    assert change["bytes_in"] == sum(t.nbytes for t in written.values())
    assert change["bytes_out"] == 6 * (PL + SL) * 8 + 6 * SL * 8  # int64 columns
    assert change["write_requests"] == dock.layout.num_warehouses  # one per warehouse
    # distributed: samples 0..5 from warehouse 0, 6..11 from both; central: one read per get
    assert change["read_requests"] == {"distributed": 3, "central": 2}[dock.mode]
    assert (change["reference_requests"], change["reference_samples_handed_out"]) == (2, 12)
    assert change["reference_mark_ready_calls"] == 1
    stats = dock.stats()
    assert stats["controllers"]["reference"]["metadata_bytes"] > 0
    json.dumps(stats)  # JSON-serialisable for metrics


def test_put_groups_sends_each_prompt_once_and_reads_back_as_put(dock: TransferDock) -> None:
    before = counters(dock)
    groups = torch.tensor([3, 0])  # group slots out of order, across both warehouses
    rows = (groups[:, None] * GROUP_SIZE + torch.arange(GROUP_SIZE)).reshape(-1)  # (k*N,)
    prompts = torch.stack([torch.arange(PL) + 100 * g for g in groups.tolist()])  # (k, PL), one per group
    responses = samples(rows.tolist(), ("response_ids",))
    dock.put_groups(groups, TensorDict({"prompt_ids": prompts}, batch_size=[2]), samples=responses)
    indices, batch = dock.get("reference", ["prompt_ids", "response_ids"], batch_size=8)
    assert indices.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert torch.equal(batch["prompt_ids"], prompts.flip(0).repeat_interleave(GROUP_SIZE, dim=0))
    assert torch.equal(batch["response_ids"], samples(indices.tolist(), ("response_ids",))["response_ids"])
    change = {key: value - before[key] for key, value in counters(dock).items()}
    assert change["bytes_in"] == prompts.numpy().nbytes + responses["response_ids"].numpy().nbytes
    assert change["reference_mark_ready_calls"] == 1


def test_put_groups_counts_shared_token_columns_for_every_sample(dock: TransferDock) -> None:
    mask = (torch.arange(SL) < torch.tensor([2, 1, 3, 0])[:, None]).long()  # (G, SL): one row per group
    dock.put_groups(torch.arange(4), TensorDict({"response_mask": mask}, batch_size=[4]))
    shares = [dock.get("balanced", ["response_mask"], rank=r, batch_size=8, balance_ranks=2) for r in (0, 1)]
    tokens = [int(batch["response_mask"].sum()) for _, batch in shares]
    assert sum(tokens) == GROUP_SIZE * 6 and abs(tokens[0] - tokens[1]) <= GROUP_SIZE


def test_put_groups_refuses_a_column_given_both_ways(dock: TransferDock) -> None:
    shared = TensorDict({"reward": torch.zeros(1)}, batch_size=[1])
    with pytest.raises(ValueError, match=r"\['reward'\] are in both"):
        dock.put_groups(torch.tensor([1]), shared, samples=samples([4, 5, 6, 7], ("reward",)))


def test_reset_starts_a_new_iteration_on_the_same_storage(dock: TransferDock) -> None:
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL, ("prompt_ids", "response_ids")))
    assert dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES) is not None
    assert dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES) is None
    stored = sum(w["bytes_stored"] for w in dock.stats()["warehouses"])
    dock.reset()
    with pytest.raises(DockTimeoutError, match="0 are ready"):
        dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES, timeout_s=0.2)
    fresh = samples(ALL, ("prompt_ids", "response_ids"))
    fresh["prompt_ids"] += 7
    dock.put(torch.arange(NUM_SAMPLES), fresh)
    indices, batch = dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES)
    assert torch.equal(batch["prompt_ids"], fresh["prompt_ids"])
    assert sum(w["bytes_stored"] for w in dock.stats()["warehouses"]) == stored  # no reallocation


def test_recycled_groups_start_over_in_every_state_and_the_kept_ones_stay(dock: TransferDock) -> None:
    """Dynamic sampling's drop: groups 1 and 3 (samples 4-7, 12-15) are emptied and refilled in
    the dock, groups 0 and 2 never leave it, and every state sees only the refilled rows anew."""
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
    taken, _ = dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES)
    assert taken.tolist() == ALL
    dropped = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    dock.recycle(dropped)
    with pytest.raises(DockTimeoutError, match="8 are not"):  # emptied: not ready until written again
        dock.get("reference", ["prompt_ids"], batch_size=8, timeout_s=0.2)
    refill = samples(dropped.tolist(), ("prompt_ids", "response_ids"))
    refill["prompt_ids"] += 7
    dock.put(dropped, refill)
    indices, batch = dock.get("reference", ["prompt_ids", "response_ids"], batch_size=NUM_SAMPLES)
    assert indices.tolist() == dropped.tolist()  # only the refilled rows come out again
    assert torch.equal(batch["prompt_ids"], refill["prompt_ids"])
    assert dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES) is None
    # A downstream state has the kept groups ready, the refilled ones wait for their other columns.
    indices, batch = dock.get("update", list(COLUMNS), batch_size=8, whole_groups=True)
    assert indices.tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert_matches(indices, batch)
    with pytest.raises(DockTimeoutError):
        dock.get("update", list(COLUMNS), batch_size=8, whole_groups=True, timeout_s=0.2)
    with pytest.raises(ValueError, match="whole groups"):
        dock.recycle(torch.tensor([0, 1]))


def test_a_dead_consumers_unfinished_groups_go_to_the_others_and_its_finished_ones_stay(dock: TransferDock) -> None:
    """A rollout pool engine's death: rank 7 took groups 0 and 1 of `update` and wrote its output
    (`half_logprobs`, which `bf16` reads) for group 0 only. Handing rank 7 back returns group 1 alone to the
    state's other consumers; group 0 stays done. A rank that took nothing hands back nothing."""
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
    taken, _ = dock.get("update", list(COLUMNS), batch_size=8, whole_groups=True, rank=7)
    assert taken.tolist() == list(range(8))
    dock.put(torch.arange(4), TensorDict({"half_logprobs": torch.zeros(4, SL, dtype=torch.bfloat16)}, batch_size=[4]))
    assert dock.hand_back("update", 7, outputs=["half_logprobs"]) == 4
    assert dock.hand_back("update", 3, outputs=["half_logprobs"]) == 0
    again, _ = dock.get("update", list(COLUMNS), batch_size=8, whole_groups=True, rank=2)
    assert again.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # group 1 first (the lowest), then one not taken before
    # No state reads `unread_column`: nothing shows what rank 2 finished, so all it took goes back.
    assert dock.hand_back("update", 2, outputs=["unread_column"]) == 8
    with pytest.raises(ValueError, match="unknown dock state 'rollout'"):
        dock.hand_back("rollout", 2, outputs=["half_logprobs"])
    # A state dealt over ranks by tokens keeps each rank's share its own: nothing hands back a dead rank's.
    mask = (torch.arange(SL) < torch.tensor([2, 1, 3, 0])[:, None]).long()
    dock.put_groups(torch.arange(4), TensorDict({"response_mask": mask}, batch_size=[4]))
    assert dock.get("balanced", ["response_mask"], rank=0, batch_size=8, balance_ranks=2) is not None
    with pytest.raises(ValueError, match="deals its samples over ranks"):
        dock.hand_back("balanced", 1, outputs=["half_logprobs"])


def test_caller_errors(dock: TransferDock) -> None:
    with pytest.raises(ValueError, match="unknown dock state 'rollout'"):
        dock.get("rollout", ["prompt_ids"], batch_size=1)
    with pytest.raises(ValueError, match="cannot read"):
        dock.get("reference", ["reward"], batch_size=1)
    with pytest.raises(ValueError, match="batch size"):
        dock.put(torch.arange(3), samples([0, 1]))
    with pytest.raises(ValueError, match="distinct"):
        dock.put(torch.tensor([1, 1]), samples([1, 1]))
    with pytest.raises(IndexError):
        dock.put(torch.tensor([NUM_SAMPLES]), samples([NUM_SAMPLES]))
    with pytest.raises(ValueError, match="per-sample shape"):
        dock.put(torch.tensor([1]), TensorDict({"reward": torch.zeros(1, 2)}, batch_size=[1]))


def masks(lengths: list[int]) -> TensorDict:
    """response_mask rows with `lengths` ones each: (B, SL) int64."""
    lengths_t = torch.tensor(lengths)
    return TensorDict({"response_mask": (torch.arange(SL) < lengths_t[:, None]).long()}, batch_size=[len(lengths)])


def test_balanced_hand_out_levels_tokens_over_ranks(dock: TransferDock) -> None:
    lengths = [6, 6, 6, 6, 5, 1, 1, 1, 1, 1, 1, 0, 2, 2, 3, 4]  # skewed: early samples are long
    dock.put(torch.arange(8), masks(lengths[:8]))
    with pytest.raises(DockTimeoutError, match="balanced hand-out over 2 ranks waits for every sample"):
        dock.get("balanced", ["response_mask"], rank=0, batch_size=8, balance_ranks=2, timeout_s=0.2)
    dock.put(torch.arange(8, 16), masks(lengths[8:]))
    shares = [dock.get("balanced", ["response_mask"], rank=r, batch_size=8, balance_ranks=2) for r in (1, 0)]
    taken = {r: share[0].tolist() for r, share in zip((1, 0), shares)}
    assert sorted(taken[0] + taken[1]) == ALL
    expected = balance_by_tokens(torch.tensor(lengths).numpy(), 2)
    assert [taken[0], taken[1]] == [part.tolist() for part in expected]
    tokens = [sum(lengths[i] for i in taken[r]) for r in (0, 1)]
    assert abs(tokens[0] - tokens[1]) <= 1  # 26 tokens: 13 each
    for (_, batch), r in zip(shares, (1, 0)):
        assert batch["response_mask"].sum().item() == tokens[r]  # the counted tokens are the data
    assert dock.get("balanced", ["response_mask"], rank=0, batch_size=8, balance_ranks=2) is None
    with pytest.raises(ValueError, match="one mode per state"):
        dock.get("balanced", ["response_mask"], rank=0, batch_size=8)


def test_state_dict_round_trip_requeues_unfinished_samples(dock: TransferDock) -> None:
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL, ("prompt_ids", "response_ids")))
    finished, _ = dock.get("reference", ["prompt_ids"], batch_size=4)  # its output gets written
    lost, _ = dock.get("reference", ["prompt_ids"], batch_size=4)  # its output is lost in a crash
    dock.put(finished, samples(finished.tolist(), ("old_logprobs", "reward")))
    saved = dock.state_dict()
    dock.reset()  # what a restarted dock starts from
    dock.load_state_dict(saved, produces={"reference": ["old_logprobs"]})
    again = dock.get("reference", ["prompt_ids", "response_ids"], batch_size=NUM_SAMPLES)
    assert again[0].tolist() == lost.tolist() + ALL[8:]  # finished samples are not redone
    assert_matches(*again)
    restored = dock.get("update", ["old_logprobs", "reward"], batch_size=4, timeout_s=0.2)
    assert restored[0].tolist() == finished.tolist()
    assert_matches(*restored)
    with pytest.raises(ValueError, match="does not fit"):
        dock.load_state_dict({**saved, "layout": (8, 4, 1)})


def test_a_state_that_writes_nothing_gets_back_everything_it_took(dock: TransferDock) -> None:
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
    dock.get("update", ["old_logprobs"], batch_size=8)  # the update's weights die with its worker
    saved = dock.state_dict()
    dock.reset()
    dock.load_state_dict(saved, produces={"update": ()})
    assert dock.get("update", ["old_logprobs"], batch_size=NUM_SAMPLES)[0].tolist() == ALL
    assert dock.can_load(saved) and not dock.can_load({**saved, "mode": "other"})
    # A flow that changed between attempts (e.g. the advantage fused into the reward): the states differ.
    fewer_states = {name: snapshot for name, snapshot in saved["controllers"].items() if name != "update"}
    assert not dock.can_load({**saved, "controllers": fewer_states})
    other_columns = {**saved["controllers"], "update": {**saved["controllers"]["update"], "columns": ["reward"]}}
    assert not dock.can_load({**saved, "controllers": other_columns})


def test_samples_the_policy_leaves_behind_are_dropped_from_bounded_states(kind: str) -> None:
    spec = spec_of(kind, timeout_s=5, max_staleness=1, on_stale="drop")
    dock = TransferDock.create(
        spec, states=STATES, num_samples=NUM_SAMPLES, group_size=GROUP_SIZE, bounded_states=["update"], **KINDS[kind][1]
    )
    try:
        dock.put(torch.arange(8), samples(ALL[:8]), policy_version=0)
        dock.put(torch.arange(8, 16), samples(ALL[8:]), policy_version=1)
        dock.set_policy_version(1)  # version 0 is one behind: allowed
        assert dock.stats()["controllers"]["update"]["stale_dropped"] == 0
        dock.set_policy_version(2)
        stats = dock.stats()["controllers"]
        assert (stats["update"]["stale_dropped"], stats["reference"]["stale_dropped"]) == (8, 0)
        assert dock.get("update", ["reward"], batch_size=NUM_SAMPLES)[0].tolist() == ALL[8:]
        assert dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES)[0].tolist() == ALL
        with pytest.raises(ValueError, match="policy_version must be >= 0"):
            dock.put(torch.arange(2), samples([0, 1]), policy_version=-1)
    finally:
        dock.shutdown()
    with pytest.raises(ValueError, match="not dock states"):
        TransferDock.create(
            spec, states=STATES, num_samples=NUM_SAMPLES, group_size=GROUP_SIZE, bounded_states=["rollout"]
        )


def killable_dock(kind: str, states: dict[str, list[str]]) -> TransferDock:
    spec = spec_of(kind, timeout_s=60) if kind == "central" else spec_of(kind, num_warehouses=2, timeout_s=60)
    return TransferDock.create(spec, states=states, num_samples=8, group_size=2, **KINDS[kind][1])


def holder_of_warehouse(dock: TransferDock, w: int):
    """The dock actor holding warehouse `w`: its own actor, or the controller host / central buffer."""
    return next(
        peer for peer in dock._route.peers() if f"warehouse {w} (" in peer.name or "central buffer" in peer.name
    )


def test_a_dead_dock_actor_fails_put_and_get_at_once_naming_it(kind: str, kill_actor) -> None:
    states = {"reference": ["prompt_ids"], "update": ["prompt_ids"]}
    dock = killable_dock(kind, states)
    victim = holder_of_warehouse(dock, 1)
    name = "central buffer" if kind == "central" else "warehouse 1 (samples [4, 8)"
    try:
        dock.put(torch.arange(8), samples(list(range(8)), ("prompt_ids",)))
        kill_actor(victim.handle)
        started = time.monotonic()
        with pytest.raises(DockActorDiedError, match=re.escape(name)):
            dock.put(torch.arange(8), samples(list(range(8)), ("prompt_ids",)))
        with pytest.raises(DockActorDiedError, match=re.escape(name)):
            dock.get("reference", ["prompt_ids"], batch_size=8)
        assert time.monotonic() - started < 10
    finally:
        dock.shutdown()


def test_a_consumer_waiting_for_samples_learns_that_a_warehouse_died(kind: str) -> None:
    dock = killable_dock(kind, {"reference": ["prompt_ids"]})
    victim = holder_of_warehouse(dock, 0)
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            waiting = pool.submit(dock.get, "reference", ["prompt_ids"], batch_size=8)  # nothing put
            time.sleep(0.5)
            started = time.monotonic()
            ray.kill(victim.handle)
            with pytest.raises(DockActorDiedError, match="warehouse 0|central buffer") as caught:
                waiting.result(timeout=30)
        assert time.monotonic() - started < 10  # well before the dock's 60 s timeout
        assert "resume from the last checkpoint" in str(caught.value)
    finally:
        dock.shutdown()


@pytest.mark.parametrize("layout", ["warehouse-actors", "distributed"])
def test_a_dead_controller_host_fails_its_consumers_and_the_writers_that_tell_it(kill_actor, layout: str) -> None:
    """Through Ray (warehouse actors) and over the host's local socket (distributed, on its node)."""
    dock = killable_dock(layout, {"reference": ["prompt_ids"], "update": ["prompt_ids"]})
    host = dock._route.peers()[-1]  # the one actor holding every state's controller
    name = "dock controller host (the controllers of states ['reference', 'update']"
    try:
        assert host.name.startswith(name)
        assert (dock._route._local_host is not None) == (layout == "distributed")
        kill_actor(host.handle)
        with pytest.raises(DockActorDiedError, match=re.escape(name)):
            dock.get("update", ["prompt_ids"], batch_size=2)
        with pytest.raises(DockActorDiedError, match=re.escape(name)):
            dock.put(torch.arange(2), samples([0, 1], ("prompt_ids",)))
    finally:
        dock.shutdown()


def test_on_one_node_the_controller_host_holds_every_warehouse(dock: TransferDock, kind: str) -> None:
    """Colocated (the default): no warehouse actor at all, so a put or get is one call to the host;
    without colocation every warehouse is an actor beside the host."""
    peers = dock._route.peers()
    if kind == "central":
        assert [peer.name.split(" (")[0] for peer in peers] == ["central buffer"]
    elif kind in ("distributed", "host-reads"):
        assert len(peers) == 1 and "with warehouse 0 (samples [0, 8)" in peers[0].name
        assert "warehouse 1 (samples [8, 16)" in peers[0].name
    else:
        assert [peer.name.split(" (")[0] for peer in peers] == ["warehouse 0", "warehouse 1", "dock controller host"]
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
    stats = dock.stats()
    assert stats["controllers"]["update"]["ready_now"] == NUM_SAMPLES  # known when put returns
    indices, batch = dock.get("update", list(COLUMNS), batch_size=12)
    assert indices.tolist() == ALL[:12]
    assert_matches(indices, batch)
    assert [w["node_id"] for w in dock.stats()["warehouses"]] == dock.warehouse_nodes()


def test_on_its_node_a_worker_moves_rows_through_shared_memory(dock: TransferDock, kind: str) -> None:
    """By default every put and get here touches the rows in shared memory (counted as shared
    requests, with the same bytes as a call would move); otherwise the dock's actors move them.
    A column's first write goes through its warehouse's owner, which allocates it."""
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
    dock.reset()
    before = dock.stats()["warehouses"]
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
    indices, batch = dock.get("update", list(COLUMNS), batch_size=NUM_SAMPLES)
    assert_matches(indices, batch)
    after = dock.stats()["warehouses"]
    shared = kind == "distributed"
    assert [w["shared_memory"] for w in after] == [shared] * len(after)
    for old, new in zip(before, after):
        change = {
            key: new[key] - old[key]
            for key in ("write_requests", "read_requests", "shared_write_requests", "shared_read_requests")
        }
        assert change["write_requests"] == change["read_requests"] == 1
        assert change["shared_write_requests"] == change["shared_read_requests"] == int(shared)
    # The rows handed out are copies: a later write of the same samples does not change them.
    dock.reset()
    dock.put(torch.arange(NUM_SAMPLES), samples([i + 1 for i in ALL]))
    assert_matches(indices, batch)


def test_on_its_node_a_worker_calls_the_controllers_over_the_host_s_local_socket(dock: TransferDock, kind: str) -> None:
    """Only where the host's warehouses share memory (the default): a socket beside them that only
    this user can open; the central buffer and the layouts without shared memory call through Ray."""
    local = dock._route._local_host
    if kind != "distributed":
        assert local is None
        return
    assert local is not None and Path(local.path).parent == Path(dock._route._shared_directories[0])
    assert stat.S_IMODE(os.stat(local.path).st_mode) == 0o600
    # A call from another thread has a connection of its own; both see the same controllers.
    dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
    with ThreadPoolExecutor(max_workers=1) as pool:
        other = pool.submit(dock.get, "update", list(COLUMNS), batch_size=8).result(timeout=30)
    mine = dock.get("update", list(COLUMNS), batch_size=8)
    assert sorted(other[0].tolist() + mine[0].tolist()) == ALL


def test_warehouse_actors_share_their_rows_with_workers_on_their_node(ray_session: None) -> None:
    """Warehouses that are actors of their own (colocate off) share memory too: the put and the
    get touch their rows directly, and the actors keep the counters and the checkpoint rows."""
    dock = make_dock(DockSpec(num_warehouses=2, timeout_s=5), colocate_controllers=False)
    try:
        dock.put(torch.arange(NUM_SAMPLES), samples(ALL))  # the first write of a column allocates it
        assert [w["shared_write_requests"] for w in dock.stats()["warehouses"]] == [0, 0]
        dock.reset()
        dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
        indices, batch = dock.get("update", list(COLUMNS), batch_size=NUM_SAMPLES)
        assert_matches(indices, batch)
        stats = dock.stats()["warehouses"]
        assert [(w["shared_write_requests"], w["shared_read_requests"]) for w in stats] == [(1, 1), (1, 1)]
        snapshot = dock.state_dict()
        for part in snapshot["warehouses"]:  # rows written in place are in the actor's checkpoint
            assert sorted(part["columns"]) == sorted(COLUMNS)
            assert len(part["columns"]["reward"][0]) == NUM_SAMPLES // 2
    finally:
        dock.shutdown()


def test_a_column_kept_out_of_shared_memory_is_read_through_the_host(ray_session: None) -> None:
    """Where /dev/shm had no room for a column, the host keeps it in private memory and leaves it
    out of the shared catalog (test_shared_columns.py): a reader on its node then asks the host."""
    from rldock.runtime.dock import distributed

    dock = make_dock(DockSpec(timeout_s=5))
    try:
        dock.put(torch.arange(NUM_SAMPLES), samples(ALL))
        catalog_path = Path(dock._route._shared_directories[0]) / "columns.json"
        catalog = json.loads(catalog_path.read_text())
        del catalog["reward"]  # as if the host had kept it private
        catalog_path.write_text(json.dumps(catalog))
        distributed._ATTACHED.clear()  # this process forgets what it had mapped
        indices, batch = dock.get("update", list(COLUMNS), batch_size=NUM_SAMPLES)
        assert_matches(indices, batch)
        (stats,) = dock.stats()["warehouses"]
        assert (stats["read_requests"], stats["shared_read_requests"]) == (1, 0)
    finally:
        dock.shutdown()
