"""Policy versions and the staleness bound: the pure rule, and a controller applying it (no Ray)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rldock.config.job import DockSpec
from rldock.runtime.dock.controller import Controller, ControllerHub
from rldock.runtime.dock.errors import DockTimeoutError
from rldock.runtime.dock.ownership import DockLayout
from rldock.runtime.dock.staleness import StalenessBound

COLUMNS = ["response_ids", "advantage"]
LAYOUT = DockLayout(num_samples=8, group_size=2, num_warehouses=2)


def test_too_old_counts_versions_behind_the_current_one() -> None:
    versions = np.array([0, 0, 1, 1, -1, -1, 2, 2])
    on_policy = StalenessBound(max_staleness=0)
    assert on_policy.too_old(versions, 2).tolist() == [True] * 4 + [False] * 4  # -1: not generated yet
    assert StalenessBound(max_staleness=1).too_old(versions, 2).tolist() == [True] * 2 + [False] * 6
    assert not StalenessBound(max_staleness=2).too_old(versions, 2).any()


def test_too_old_keeps_or_discards_groups_whole() -> None:
    versions = np.array([3, 2, 3, 3])  # group 0 has one sample from version 2
    bound = StalenessBound(max_staleness=0)
    assert bound.too_old(versions, 3).tolist() == [False, True, False, False]
    assert bound.too_old(versions, 3, group_size=2).tolist() == [True, True, False, False]


def test_the_config_refuses_bad_bounds() -> None:
    # the dock asserts them (issue 65); tests/unit/config/test_config.py names the fields
    with pytest.raises(ValueError, match="max_staleness"):
        DockSpec(max_staleness=-1)
    with pytest.raises(ValueError, match="on_stale"):
        DockSpec(on_stale="skip")  # type: ignore[arg-type]
    assert (DockSpec().max_staleness, DockSpec().on_stale) == (0, "drop")  # on-policy by default


def bounded(max_staleness: int, on_stale: str) -> Controller:
    return Controller(
        state="update",
        columns=COLUMNS,
        layout=LAYOUT,
        default_timeout_s=5.0,
        staleness=StalenessBound(max_staleness=max_staleness, on_stale=on_stale),
    )


async def write(controller: Controller, indices: list[int], version: int) -> None:
    await controller.mark_ready(np.array(indices), COLUMNS, policy_version=version)


def test_drop_discards_samples_the_policy_leaves_behind_and_counts_them() -> None:
    async def scenario() -> None:
        controller = bounded(1, "drop")
        await write(controller, [0, 1, 2, 3], version=0)
        await write(controller, [4, 5, 6, 7], version=1)
        await controller.advance_policy(1)  # version-0 samples are 1 behind: still allowed
        assert (await controller.stats())["stale_dropped"] == 0
        taken = await controller.request(0, 2)
        assert taken.indices.tolist() == [0, 1]
        await controller.advance_policy(2)  # 2 and 3 are now 2 behind: dropped; 0 and 1 were taken
        stats = await controller.stats()
        assert (stats["stale_dropped"], stats["policy_version"]) == (2, 2)
        assert (await controller.request(0, 8)).indices.tolist() == [4, 5, 6, 7]  # fewer remain
        assert (await controller.request(0, 8)).exhausted

    asyncio.run(scenario())


def test_drop_takes_the_whole_group_of_a_stale_sample() -> None:
    async def scenario() -> None:
        controller = bounded(0, "drop")
        await write(controller, [0, 2, 3], version=1)
        await write(controller, [1], version=0)  # group 0 = samples 0, 1
        await controller.advance_policy(1)
        assert (await controller.stats())["stale_dropped"] == 2
        assert (await controller.request(0, 2, whole_groups=True)).indices.tolist() == [2, 3]

    asyncio.run(scenario())


def test_wait_holds_the_new_version_until_stale_samples_are_consumed() -> None:
    async def scenario() -> None:
        controller = bounded(0, "wait")
        await write(controller, [0, 1, 2, 3], version=0)
        advancing = asyncio.ensure_future(controller.advance_policy(1))
        await asyncio.sleep(0.05)
        assert not advancing.done()
        assert (await controller.stats())["policy_version"] == 0
        await controller.request(0, 2)
        await asyncio.sleep(0.05)
        assert not advancing.done()  # samples 2 and 3 are still waiting for a consumer
        await controller.request(1, 2)
        await asyncio.wait_for(advancing, 1.0)
        stats = await controller.stats()
        assert (stats["policy_version"], stats["stale_waits"], stats["stale_dropped"]) == (1, 1, 0)
        assert stats["stale_wait_s"] > 0.05

    asyncio.run(scenario())


def test_wait_times_out_with_the_count_and_the_setting() -> None:
    async def scenario() -> None:
        controller = bounded(0, "wait")
        await write(controller, [0, 1], version=0)
        with pytest.raises(DockTimeoutError, match=r"2 unconsumed samples .*max_staleness=0.*on_stale=wait"):
            await controller.advance_policy(1, timeout_s=0.05)

    asyncio.run(scenario())


def test_states_without_a_bound_ignore_versions() -> None:
    async def scenario() -> None:
        hub = ControllerHub(
            states={"update": COLUMNS, "reference": COLUMNS},
            layout=LAYOUT,
            default_timeout_s=1.0,
            staleness=StalenessBound(max_staleness=0, on_stale="drop"),
            bounded_states=["update"],
        )
        await hub.mark_ready(np.arange(8), COLUMNS, policy_version=0)
        await hub.advance_policy(3)
        stats = await hub.stats()
        assert (stats["update"]["stale_dropped"], stats["reference"]["stale_dropped"]) == (8, 0)
        assert (await hub.request("reference", 0, 8)).indices.tolist() == list(range(8))
        assert (await hub.request("update", 0, 8)).exhausted
        with pytest.raises(ValueError, match="unknown dock states"):
            ControllerHub(states={"update": COLUMNS}, layout=LAYOUT, default_timeout_s=1.0, bounded_states=["rollout"])

    asyncio.run(scenario())


def test_a_balanced_deal_does_not_wait_for_dropped_samples() -> None:
    async def scenario() -> None:
        controller = bounded(0, "drop")
        await controller.mark_ready(np.arange(4), ["response_ids"], policy_version=0)  # stale, never finished
        await controller.advance_policy(1)
        await controller.mark_ready(np.arange(4, 8), COLUMNS, policy_version=1)
        shares = [await controller.request(r, 4, balance_ranks=2) for r in (0, 1)]
        assert sorted(i for share in shares for i in share.indices.tolist()) == [4, 5, 6, 7]

    asyncio.run(scenario())


def test_versions_survive_a_snapshot() -> None:
    async def scenario() -> None:
        controller = bounded(0, "drop")
        await write(controller, [0, 1], version=0)
        await controller.advance_policy(0)
        saved = await controller.snapshot()
        restored = bounded(0, "drop")
        await restored.restore(saved)
        await restored.advance_policy(1)
        assert (await restored.stats())["stale_dropped"] == 2

    asyncio.run(scenario())
