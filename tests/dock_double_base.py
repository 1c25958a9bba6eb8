"""What every test double of the transfer dock shares: the stage loop's fused call (TransferDock.put_and_get)
as the put and the get it stands for, so a double implements only those two."""

from __future__ import annotations

from typing import Any


class PutThenGet:
    """`put_and_get` of a double that has `put` and `get`: the write, then the request."""

    def put_and_get(
        self, indices: Any, out: Any, state: str, columns: Any, *, policy_version: Any = None, **request: Any
    ):
        self.put(indices, out, policy_version=policy_version)  # type: ignore[attr-defined]
        return self.get(state, columns, **request)  # type: ignore[attr-defined]
