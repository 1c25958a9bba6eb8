"""Dock banks: iteration i uses bank i mod the number of banks; every bank serves the same states."""

from __future__ import annotations

import pytest

from rldock.runtime.dock.banks import DockBanks


class StatesOnlyDock:
    """Test double of TransferDock: only the states the banks compare (no Ray actors)."""

    def __init__(self, states: dict[str, tuple[str, ...]]):
        self.states = states
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


STATES = {"rollout": ("prompt_ids",), "update": ("prompt_ids", "response_ids")}


def test_iterations_alternate_between_the_banks_and_all_shut_down():
    docks = [StatesOnlyDock(STATES), StatesOnlyDock(STATES)]
    banks = DockBanks(docks)
    assert [banks.bank(i) for i in (1, 2, 3, 4)] == [docks[1], docks[0], docks[1], docks[0]]
    assert banks.states == STATES
    banks.shutdown()
    assert all(dock.shut_down for dock in docks)


def test_one_bank_serves_every_iteration():
    dock = StatesOnlyDock(STATES)
    assert {DockBanks([dock]).bank(i) for i in range(5)} == {dock}


def test_banks_of_different_states_are_refused():
    with pytest.raises(ValueError, match="same states"):
        DockBanks([StatesOnlyDock(STATES), StatesOnlyDock({"rollout": ("prompt_ids",)})])
    with pytest.raises(ValueError, match="at least one"):
        DockBanks([])
