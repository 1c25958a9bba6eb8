"""A controller as a plain object on an asyncio loop (no Ray): hand-out rules and waiting."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from rldock.runtime.dock.controller import Controller, ControllerHub
from rldock.runtime.dock.errors import DockTimeoutError
from rldock.runtime.dock.ownership import DockLayout

COLUMNS = ["response_ids", "old_logprobs"]


def make_controller(*, num_samples: int = 8, group_size: int = 2, num_warehouses: int = 2) -> Controller:
    layout = DockLayout(num_samples=num_samples, group_size=group_size, num_warehouses=num_warehouses)
    return Controller(state="reference", columns=COLUMNS, layout=layout, default_timeout_s=5.0)


async def ready(controller: Controller, indices: list[int], columns: list[str] = COLUMNS) -> None:
    await controller.mark_ready(np.array(indices), columns)


def test_hands_out_ready_samples_in_ascending_order_grouped_by_warehouse() -> None:
    async def scenario() -> None:
        controller = make_controller()
        await ready(controller, [6, 1, 5, 0])
        grant = await controller.request(0, 3)
        assert grant.indices.tolist() == [0, 1, 5]
        assert {w: idx.tolist() for w, idx in grant.by_warehouse.items()} == {0: [0, 1], 1: [5]}

    asyncio.run(scenario())


def test_a_sample_needs_every_required_column_and_ignores_others() -> None:
    async def scenario() -> None:
        controller = make_controller()
        await ready(controller, [0, 1], ["response_ids", "unrelated"])
        with pytest.raises(DockTimeoutError):
            await controller.request(0, 1, timeout_s=0.05)
        await ready(controller, [1], ["old_logprobs"])
        assert (await controller.request(0, 1)).indices.tolist() == [1]

    asyncio.run(scenario())


def test_waiting_request_is_served_when_the_column_arrives() -> None:
    async def scenario() -> None:
        controller = make_controller()
        await ready(controller, [0, 1, 2, 3], ["response_ids"])
        waiting = asyncio.ensure_future(controller.request(0, 4, timeout_s=5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await ready(controller, [0, 1, 2], ["old_logprobs"])
        await asyncio.sleep(0.05)
        assert not waiting.done()  # 3 of 4 ready: keep waiting
        await ready(controller, [3], ["old_logprobs"])
        grant = await asyncio.wait_for(waiting, 1.0)
        assert grant.indices.tolist() == [0, 1, 2, 3]
        assert grant.waited_s >= 0.1  # reported so workers can tell waiting from moving data
        await ready(controller, [4, 5], COLUMNS)
        assert (await controller.request(0, 2)).waited_s < 0.05  # ready at once: no wait

    asyncio.run(scenario())


def test_each_sample_goes_to_one_rank_and_then_the_state_is_exhausted() -> None:
    async def scenario() -> None:
        controller = make_controller()
        requests = [controller.request(rank, 3, timeout_s=2.0) for rank in (0, 1, 0, 1)]
        pending = asyncio.gather(*requests)
        await ready(controller, list(range(8)))
        grants = await pending
        taken = np.concatenate([g.indices for g in grants])
        assert sorted(taken.tolist()) == list(range(8))  # disjoint and complete: 3 + 3 + 2 + 0
        assert sorted(g.indices.size for g in grants) == [0, 2, 3, 3]
        assert sum(g.exhausted for g in grants) == 1
        assert (await controller.request(1, 3)).exhausted

    asyncio.run(scenario())


def test_a_waiter_learns_of_exhaustion_caused_by_another_rank() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=4, num_warehouses=1)
        await ready(controller, [0, 1])
        assert (await controller.request(0, 2)).indices.tolist() == [0, 1]
        waiting = asyncio.ensure_future(controller.request(1, 4, timeout_s=5.0))  # wants the last 2
        await asyncio.sleep(0.02)
        await ready(controller, [2, 3])
        other = await controller.request(0, 2)
        first = await asyncio.wait_for(waiting, 1.0)
        assert sorted([first.indices.tolist(), other.indices.tolist()]) == [[], [2, 3]]

    asyncio.run(scenario())


def test_whole_groups_never_split() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=12, group_size=3, num_warehouses=2)
        await ready(controller, [0, 1, 3, 4, 5, 6, 7])  # group 1 complete, groups 0 and 2 partial
        grant = await controller.request(0, 3, whole_groups=True)
        assert grant.indices.tolist() == [3, 4, 5]
        with pytest.raises(DockTimeoutError, match="0 complete groups of 3 ready"):
            await controller.request(0, 3, whole_groups=True, timeout_s=0.05)
        await ready(controller, [2, 8])
        assert (await controller.request(1, 6, whole_groups=True)).indices.tolist() == [0, 1, 2, 6, 7, 8]

    asyncio.run(scenario())


def test_invalid_requests_are_refused() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=12, group_size=3)
        with pytest.raises(ValueError, match="multiple of the group size 3"):
            await controller.request(0, 4, whole_groups=True)
        with pytest.raises(ValueError, match="batch_size"):
            await controller.request(0, 0)
        await ready(controller, list(range(12)))
        await controller.request(0, 3, whole_groups=True)
        with pytest.raises(ValueError, match="one mode per state"):
            await controller.request(1, 3, whole_groups=False)

    asyncio.run(scenario())


def test_timeout_is_prompt_and_explains_what_is_missing() -> None:
    async def scenario() -> None:
        controller = make_controller()
        await ready(controller, [0, 1, 2], ["response_ids"])
        await ready(controller, [0], ["old_logprobs"])
        started = time.monotonic()
        with pytest.raises(DockTimeoutError) as caught:
            await controller.request(1, 4, timeout_s=0.1)
        assert time.monotonic() - started < 1.0
        message = str(caught.value)
        for part in [
            "'reference'",
            "rank 1",
            "response_ids",
            "old_logprobs",
            "8 samples remaining",
            "1 are ready",
            "7 are not",
            "'response_ids': 5",
            "'old_logprobs': 7",
        ]:
            assert part in message, message
        assert (await controller.stats())["timeouts"] == 1

    asyncio.run(scenario())


def test_reset_starts_a_new_iteration() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=4, num_warehouses=1)
        await ready(controller, [0, 1, 2, 3])
        assert (await controller.request(0, 4)).indices.size == 4
        assert (await controller.request(0, 4)).exhausted
        await controller.reset()
        with pytest.raises(DockTimeoutError, match="0 are ready"):
            await controller.request(0, 4, timeout_s=0.05)
        await ready(controller, [0, 1, 2, 3])
        assert (await controller.request(1, 4)).indices.tolist() == [0, 1, 2, 3]

    asyncio.run(scenario())


def test_counters() -> None:
    async def scenario() -> None:
        controller = make_controller()
        await ready(controller, list(range(8)))
        await ready(controller, [0], ["unrelated"])
        await controller.request(0, 5)
        await controller.request(1, 5)
        stats = await controller.stats()
        assert stats["requests"] == 2 and stats["samples_handed_out"] == 8
        assert stats["mark_ready_calls"] == 2
        assert 0 < stats["metadata_bytes"] < 10_000
        assert stats["ready_now"] == 8 and stats["handed_out_now"] == 8

    asyncio.run(scenario())


def test_preferred_warehouses_go_first_then_the_rest() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=8, num_warehouses=2)  # warehouse 1 owns 4..7
        await ready(controller, list(range(8)))
        assert (await controller.request(0, 3, prefer=[1])).indices.tolist() == [4, 5, 6]
        assert (await controller.request(0, 3, prefer=[1])).indices.tolist() == [0, 1, 7]  # local ran out
        assert (await controller.request(1, 3)).indices.tolist() == [2, 3]

    asyncio.run(scenario())


def test_a_rank_waits_for_its_own_samples_rather_than_take_others() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=8, num_warehouses=2)  # warehouse 1 owns 4..7
        await ready(controller, [0, 1, 2, 3, 4])
        waiting = asyncio.ensure_future(controller.request(1, 2, prefer=[1], timeout_s=5.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # 0..3 are ready, but its own 5..7 will come
        await ready(controller, [5])
        assert (await asyncio.wait_for(waiting, 1.0)).indices.tolist() == [4, 5]
        await ready(controller, [6])
        # 2 of its own remain unconsumed (6 ready, 7 not): fewer than 3, so it fills up with others
        assert (await controller.request(1, 3, prefer=[1])).indices.tolist() == [0, 1, 6]

    asyncio.run(scenario())


def test_preferred_warehouses_with_whole_groups() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=12, group_size=2, num_warehouses=3)
        await ready(controller, list(range(12)))
        grant = await controller.request(0, 4, whole_groups=True, prefer=[2])
        assert grant.indices.tolist() == [8, 9, 10, 11]
        assert list(grant.by_warehouse) == [2]

    asyncio.run(scenario())


def test_balanced_hand_out_waits_for_the_whole_batch_then_deals_by_tokens() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=8, group_size=2, num_warehouses=2)
        tokens = np.array([100, 90, 5, 5, 5, 5, 80, 10])
        waiting = asyncio.ensure_future(controller.request(1, 4, balance_ranks=2, timeout_s=5.0))
        await controller.mark_ready(np.arange(6), COLUMNS, {"response_mask": tokens[:6]})
        await asyncio.sleep(0.05)
        assert not waiting.done()  # 6 of 8 ready: the deal needs all of them
        await controller.mark_ready(np.arange(6, 8), COLUMNS, {"response_mask": tokens[6:]})
        share1 = (await asyncio.wait_for(waiting, 1.0)).indices
        share0 = (await controller.request(0, 4, balance_ranks=2)).indices
        assert sorted([*share0.tolist(), *share1.tolist()]) == list(range(8))
        assert (share0.size, share1.size) == (4, 4)
        loads = sorted(int(tokens[s].sum()) for s in (share0, share1))
        assert loads == [120, 180]  # the best split of 4 + 4; by index it is 100 and 200
        assert (await controller.request(0, 4, balance_ranks=2)).exhausted  # rank 0's share is gone
        with pytest.raises(ValueError, match="balanced share over 2 ranks"):
            await controller.request(2, 4, balance_ranks=2)
        assert (await controller.stats())["token_columns"] == ["response_mask"]

    asyncio.run(scenario())


def test_balanced_whole_groups_keep_groups_together() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=8, group_size=2, num_warehouses=1)
        await controller.mark_ready(np.arange(8), COLUMNS, {"t": np.array([9, 9, 1, 1, 8, 8, 2, 2])})
        share = (await controller.request(0, 4, whole_groups=True, balance_ranks=2)).indices.tolist()
        # groups hold 18, 2, 16 and 4 tokens: only {0, 1} / {2, 3} splits them 20 / 20
        assert share in ([0, 1, 2, 3], [4, 5, 6, 7])

    asyncio.run(scenario())


def test_snapshot_restore_and_requeue() -> None:
    async def scenario() -> None:
        controller = make_controller()
        await ready(controller, list(range(8)))
        await controller.request(0, 3)
        saved = await controller.snapshot()
        fresh = make_controller()
        await fresh.restore(saved, requeue=np.array([1]))
        assert (await fresh.request(0, 8)).indices.tolist() == [1, 3, 4, 5, 6, 7]
        other = Controller(state="update", columns=COLUMNS, layout=fresh._layout, default_timeout_s=1.0)
        with pytest.raises(ValueError, match="cannot be restored"):
            await other.restore(saved)

    asyncio.run(scenario())


def test_the_grant_of_the_last_samples_says_the_rank_is_drained() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=4, group_size=1)
        await ready(controller, [0, 1, 2, 3])
        first = await controller.request(0, 3)
        assert not first.drained and not first.exhausted
        last = await controller.request(1, 3)
        assert last.indices.tolist() == [3] and last.drained  # nothing left: rank 1 need not ask again
        assert (await controller.request(0, 1)).exhausted

    asyncio.run(scenario())


def test_balanced_ranks_are_drained_by_their_own_share_only() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=4, group_size=1)
        await ready(controller, [0, 1, 2, 3])
        own = await controller.request(0, 2, balance_ranks=2)
        assert own.indices.size == 2 and own.drained  # rank 0's whole share, rank 1's still untaken
        other = await controller.request(1, 2, balance_ranks=2)
        assert other.drained and sorted([*own.indices, *other.indices]) == [0, 1, 2, 3]

    asyncio.run(scenario())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("whole_groups", [False, True])
def test_hand_out_matches_a_scan_of_every_sample(seed: int, whole_groups: bool) -> None:
    """The incremental index (handout.py) gives what the obvious O(all) scan would: the smallest
    ready, untaken units, for random write orders and request sizes."""
    rng = np.random.default_rng(seed)
    num_samples, group_size = 96, 4
    unit = group_size if whole_groups else 1

    async def scenario() -> None:
        controller = make_controller(num_samples=num_samples, group_size=group_size, num_warehouses=3)
        ready_cols = np.zeros((num_samples, 2), dtype=bool)
        taken = np.zeros(num_samples, dtype=bool)
        writes = [(int(i), int(c)) for i, c in rng.permutation([(i, c) for i in range(num_samples) for c in (0, 1)])]
        for step in range(0, len(writes), 16):
            for c in (0, 1):
                rows = sorted(i for i, col in writes[step : step + 16] if col == c)
                if rows:
                    await ready(controller, rows, [COLUMNS[c]])
                    ready_cols[rows, c] = True
            free = (ready_cols.all(axis=1) & ~taken).reshape(-1, unit).all(axis=1)  # scan, by unit
            want = int(rng.integers(1, 4))
            if free.sum() >= want:
                units = np.flatnonzero(free)[:want]
                expected = (units[:, None] * unit + np.arange(unit)).ravel()
                grant = await controller.request(0, want * unit, whole_groups=whole_groups, timeout_s=1.0)
                assert grant.indices.tolist() == sorted(expected.tolist())
                taken[expected] = True

    asyncio.run(scenario())


def test_a_write_wakes_only_the_requests_it_can_serve() -> None:
    async def scenario() -> None:
        controller = make_controller(num_samples=8, num_warehouses=2)
        small = asyncio.ensure_future(controller.request(0, 2, timeout_s=5.0))
        large = asyncio.ensure_future(controller.request(1, 6, timeout_s=5.0))
        while (await controller.stats())["waiting_now"] < 2:
            await asyncio.sleep(0)  # until both requests wait in the controller
        await ready(controller, [0, 1, 2])
        assert (await small).indices.tolist() == [0, 1]
        assert not large.done() and (await controller.stats())["waiting_now"] == 1
        await ready(controller, [3, 4, 5, 6, 7])
        assert (await large).indices.tolist() == [2, 3, 4, 5, 6, 7]

    asyncio.run(scenario())


def test_the_controller_host_tells_only_the_states_a_write_concerns() -> None:
    """One process holds every state's controller; a write named for some states leaves the others'
    readiness, counters and waiting requests untouched, and `advance_policy` reaches every state."""

    async def scenario() -> None:
        layout = DockLayout(num_samples=4, group_size=2, num_warehouses=1)
        hub = ControllerHub(states={"reference": COLUMNS, "update": COLUMNS}, layout=layout, default_timeout_s=1.0)
        waiting = asyncio.ensure_future(hub.request("update", 0, 4, timeout_s=0.2))
        await asyncio.sleep(0)  # the update request is waiting in its controller before the write
        assert (await hub.stats())["update"]["waiting_now"] == 1
        await hub.mark_ready(np.arange(4), COLUMNS, states=["reference"])
        assert (await hub.request("reference", 0, 4)).indices.tolist() == [0, 1, 2, 3]
        with pytest.raises(DockTimeoutError, match="state 'update'"):
            await waiting
        stats = await hub.stats()
        assert (stats["reference"]["mark_ready_calls"], stats["update"]["mark_ready_calls"]) == (1, 0)
        with pytest.raises(ValueError, match="unknown dock state 'rollout'"):
            await hub.mark_ready(np.arange(4), COLUMNS, states=["rollout"])
        await hub.advance_policy(2)
        assert [s["policy_version"] for s in (await hub.stats()).values()] == [2, 2]

    asyncio.run(scenario())
