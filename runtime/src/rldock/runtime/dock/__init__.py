"""The transfer dock: the replay buffer every worker state writes to and reads from.

Tensors live in S warehouses (Ray actors, one per node by default), each owning a contiguous
range of whole prompt groups; one controller per worker state holds only metadata (what is
ready, who took what) and hands samples out. `TransferDock` is the client. The design follows
the distributed transfer dock of MindSpeed RL (arXiv 2507.19017); `dock.mode: central` swaps in
the single replay-buffer actor that paper compares against, behind the same client.

`TransferDock` is imported lazily: controller actors load this package too, and they need
neither torch nor tensordict, whose import costs seconds per process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rldock.runtime.dock.errors import DockActorDiedError, DockTimeoutError
from rldock.runtime.dock.ownership import DockLayout

if TYPE_CHECKING:
    from rldock.runtime.dock.client import TransferDock

__all__ = ["DockActorDiedError", "DockLayout", "DockTimeoutError", "TransferDock"]


def __getattr__(name: str) -> Any:
    if name == "TransferDock":
        from rldock.runtime.dock.client import TransferDock

        return TransferDock
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
