"""Where a forward pass's tokens sit in its batch's grid of (row, column) cells: what a pass tells the
listeners on its model before each forward (models/routing_replay.py's record and replay hooks,
models/moe.py's router record), from engines/policy.py's pass plans. Its own module so that both
model modules read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from torch import Tensor


@dataclass(frozen=True)
class PassCells:
    """Where one forward pass's tokens sit in the grid: pairs (cell, token) of a flat grid cell
    (row * (PL + SL) + column) and the index of the pass's token (of its flattened (rows, N) inputs)
    that computed it. Every real token appears at least once; a packed pass's shared prompt token
    once per row holding that prompt."""

    cells: Tensor  # (C,) int64
    tokens: Tensor  # (C,) int64

    def on_positions(self, *, width: int, local: slice) -> PassCells:
        """The cells of the tokens at positions `local` of a pass `width` positions wide (a CP rank's
        slice, engines/ulysses.py's `local_positions`), their tokens counted in the rank's own
        flattened (rows, local positions) inputs."""
        row, position = self.tokens // width, self.tokens % width
        mine = (position >= local.start) & (position < local.stop)
        local_width = local.stop - local.start
        return PassCells(cells=self.cells[mine], tokens=row[mine] * local_width + position[mine] - local.start)


class PassListener(Protocol):
    """What a pass tells before each forward: where its tokens sit in the batch's grid."""

    def begin_pass(self, cells: PassCells) -> None: ...
