"""The controller host of the distributed dock: every state's controller, plus the warehouses' handles.

It is the `ControllerHub` with one more call, `request_and_read`, used only when the dock is
built with `host_starts_reads` (a measurement switch, off by default): when a request is granted,
the host itself starts the reads of the granted rows from their owning warehouses and returns
their ObjectRefs inside the Grant, so the consumer makes one call instead of two and only fetches
the results. A warehouse's reply sits in its own node's object store and the consumer's node
pulls it from there; the host owns the refs (it submitted the reads), the consumer borrows them,
and the host never fetches them. Two costs come with Ray's ownership protocol: the consumer asks
the owner (the host) where each object is before pulling it, and a reply under Ray's inline limit
(100 KiB, `max_direct_call_object_size`) is carried to its owner in the reply message, so a small
read passes through the host's Ray worker. Measured side by side (docs/dock-benchmarks.md), a
get is 1.1-1.4x slower from a worker actor and the dispatch benchmark shows no gain beyond its
noise, hence off by default.

numpy only in this process too: the host never touches a tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ray.actor import ActorHandle

from rldock.runtime.dock.controller import ControllerHub, Grant
from rldock.runtime.dock.ownership import DockLayout
from rldock.runtime.dock.staleness import StalenessBound


class ControllerHost(ControllerHub):
    """The controllers of every state in one event loop, able to start warehouse reads for a grant."""

    def __init__(self, *, states: dict[str, Sequence[str]], layout: DockLayout, default_timeout_s: float,
                 warehouses: Sequence[ActorHandle], staleness: StalenessBound | None = None,
                 bounded_states: Sequence[str] = ()) -> None:
        super().__init__(states=states, layout=layout, default_timeout_s=default_timeout_s, staleness=staleness,
                         bounded_states=bounded_states)
        if len(warehouses) != layout.num_warehouses:
            raise ValueError(f"the controller host got {len(warehouses)} warehouse handles for a layout of "
                             f"{layout.num_warehouses} warehouses")
        self._warehouses = list(warehouses)

    async def request_and_read(self, state: str, columns: Sequence[str], rank: int, batch_size: int,
                               whole_groups: bool = False, timeout_s: float | None = None, *,
                               prefer: Sequence[int] = (), balance_ranks: int = 0) -> Grant:
        """`request`, and once granted, the reads of `columns` of the granted rows, started here.

        The Grant's `reads` hold one ObjectRef per owning warehouse, in warehouse order (which is
        index order, ownership being contiguous); the caller fetches them.
        """
        grant = await self.request(state, rank, batch_size, whole_groups, timeout_s, prefer=prefer,
                                   balance_ranks=balance_ranks)
        if grant.exhausted:
            return grant
        names = list(columns)
        reads = {w: self._warehouses[w].read.remote(rows, names) for w, rows in sorted(grant.by_warehouse.items())}
        return replace(grant, reads=reads)
