"""The controller host without Ray: a write to its own warehouses is ready when it returns, a grant
carries the rows it holds (copies, not views of storage), and the rows of warehouse actors are left
to the caller."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from rldock.runtime.dock.host import ControllerHost
from rldock.runtime.dock.ownership import DockLayout
from rldock.runtime.dock.wire import to_wire

LAYOUT = DockLayout(num_samples=8, group_size=2, num_warehouses=2)  # warehouse 0: 0..3, 1: 4..7


def host(hosted: list[int]) -> ControllerHost:
    return ControllerHost(states={"reference": ["prompt_ids"]}, layout=LAYOUT, default_timeout_s=1.0, hosted=hosted)


def rows(indices: list[int]) -> dict:
    return {"prompt_ids": to_wire(torch.tensor(indices)[:, None] * 10 + torch.arange(3))}  # (B, 3) int64


def test_a_grant_carries_copies_of_the_hosted_rows_and_leaves_the_others_to_the_caller() -> None:
    async def scenario() -> None:
        dock = host([0])
        await dock.write(
            {0: (np.arange(4), rows([0, 1, 2, 3]), None)}, np.arange(8), ["prompt_ids"], states=["reference"]
        )  # warehouse 1's rows went to its actor (not here)
        grant, data = await dock.request_and_read("reference", ["prompt_ids"], 0, 6)
        assert grant.indices.tolist() == [0, 1, 2, 3, 4, 5]
        assert sorted(grant.by_warehouse) == [0, 1] and sorted(data) == [0]
        got = data[0]["prompt_ids"].array.copy()
        assert got.tolist() == [[0, 1, 2], [10, 11, 12], [20, 21, 22], [30, 31, 32]]
        # A later write to the same rows (the next iteration's) leaves the handed-out rows alone.
        await dock.reset()
        await dock.write(
            {0: (np.arange(4), rows([4, 5, 6, 7]), None)}, np.arange(4), ["prompt_ids"], states=["reference"]
        )
        assert np.array_equal(data[0]["prompt_ids"].array, got)

    asyncio.run(scenario())


def test_only_hosted_warehouses_answer_warehouse_calls() -> None:
    async def scenario() -> None:
        dock = host([0])
        assert (await dock.warehouse(0, "stats"))["capacity"] == 4
        with pytest.raises(ValueError, match="warehouse 1 is not hosted"):
            await dock.warehouse(1, "stats")
        with pytest.raises(ValueError, match="not one of"):
            await dock.warehouse(0, "write", np.arange(2), {})

    asyncio.run(scenario())
