"""Dock banks: one transfer dock per iteration in flight, so the asynchronous pipeline can put the
next iteration's samples while this iteration's are still being trained on.

A dock's hand-out is per iteration: a consumer takes samples until that iteration's are exhausted,
and the driver resets the dock before putting the next batch. With `training.mode: async` two
iterations are in flight at once (iteration i's update, iteration i+1's generation and inference),
so each gets its own dock, a bank: iteration i uses bank i % num_banks. Workers receive the banks
once and pick the bank of the iteration each stage call names, so no stage ever sees the other
iteration's samples. A job with one iteration in flight has one bank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rldock.runtime.dock.client import TransferDock


class DockBanks:
    """`num_banks` transfer docks of the same states and layout, used round-robin by iteration."""

    def __init__(self, docks: Sequence[TransferDock]) -> None:
        if not docks:
            raise ValueError("DockBanks needs at least one dock")
        states = docks[0].states
        if any(dock.states != states for dock in docks[1:]):
            raise ValueError("every dock bank must serve the same states and columns")
        self._docks = tuple(docks)

    def bank(self, iteration: int) -> TransferDock:
        """The dock that carries `iteration`'s samples."""
        return self._docks[iteration % len(self._docks)]

    @property
    def docks(self) -> tuple[TransferDock, ...]:
        return self._docks

    @property
    def states(self) -> dict[str, tuple[str, ...]]:
        """Each worker state and the columns it requires (the same in every bank)."""
        return self._docks[0].states

    def shutdown(self) -> None:
        for dock in self._docks:
            dock.shutdown()
