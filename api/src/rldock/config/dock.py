"""`dock`: the transfer dock every sample moves through (docs/transfer-dock.md), and its checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from rldock.config.problem import Problem
from rldock.config.section import Spec

if TYPE_CHECKING:  # the section's checks read the whole config, which composes this section
    from rldock.config.job import JobConfig


class DockSpec(Spec):
    """The transfer dock that carries every sample between stages."""

    mode: Literal["distributed", "central"] = Field(
        default="distributed",
        description="`distributed`: one warehouse per node plus a metadata controller per worker state, "
        "tensors moving straight between workers and warehouses. `central`: one buffer actor holds "
        "every column and serves every request (the replay-buffer baseline; for comparison).",
    )
    num_warehouses: int | None = Field(
        default=None, ge=1, description="S: warehouses (distributed mode only); default one per Ray node."
    )
    timeout_s: float = Field(
        default=300.0, gt=0, description="How long a consumer waits for ready samples before failing."
    )
    max_staleness: int = Field(
        default=0,
        ge=0,
        description="How many policy versions (weight updates) a sample may lag behind the policy that trains "
        "on it. 0: on-policy. With training.mode async, 1 or more lets generation run one iteration ahead "
        "of the update (samples 1 version old); the dock applies the bound to the update's samples after "
        "every update (`on_stale`).",
    )
    on_stale: Literal["drop", "wait"] = Field(
        default="drop",
        description="What happens to a sample the policy would leave more than max_staleness versions behind: "
        "`drop` discards it (with its prompt group); `wait` holds the policy update until it is consumed.",
    )


def problems(cfg: JobConfig) -> list[Problem]:
    """Warehouses must each own a prompt group; the central buffer is one warehouse beside its controllers."""
    dock, groups = cfg.dock, cfg.algorithm.num_prompts_per_iteration
    found: list[Problem] = []
    if dock.mode == "central" and dock.num_warehouses not in (None, 1):
        found.append(
            Problem(
                "dock.num_warehouses",
                f"{dock.num_warehouses} warehouses with dock.mode central, which keeps every column in one "
                "buffer; unset it or use mode distributed",
            )
        )
    elif dock.num_warehouses is not None and dock.num_warehouses > groups:
        found.append(
            Problem(
                "dock.num_warehouses",
                f"{dock.num_warehouses} warehouses for {groups} prompt groups would leave "
                "some warehouses empty; use at most one warehouse per prompt group",
            )
        )
    return found
