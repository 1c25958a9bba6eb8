"""The dispatch benchmark's sample flow on one local Ray node (no network namespaces, no root):
its node agents start from the installed benchmarks package and one iteration moves exactly the
bytes the Eq. (2') prediction says."""

from __future__ import annotations

import pytest
import ray

from rldock.config.job import DockSpec
from rldock.runtime.dock import TransferDock
from rldock.runtime.flow.catalogue import get_recipe
from rldock.runtime.flow.columns import TOKEN_COLUMNS
from rldock_benchmarks import harness
from rldock_benchmarks.grpo_flow import Dims, predicted_bytes

CONSUMES = get_recipe("grpo").consumes


@pytest.fixture(scope="module")
def local_ray(start_local_ray):
    with start_local_ray(num_cpus=2):
        yield


@pytest.mark.parametrize("colocate", [True, False])
def test_one_iteration_of_the_flow_moves_the_predicted_bytes(local_ray, colocate: bool) -> None:
    dims = Dims(G=2, N=2, PL=8, SL=8, n=1, M=4)
    node = ray.get_runtime_context().get_node_id()
    agents, ips = harness.start_agents([node])
    assert len(ips) == 1
    dock = TransferDock.create(
        DockSpec(timeout_s=120),
        states={s: list(c) for s, c in CONSUMES.items()},
        num_samples=dims.num_samples,
        group_size=dims.N,
        token_columns=TOKEN_COLUMNS,
        node_ids=[node],
        colocate_controllers=colocate,
    )
    try:
        records = harness.run_flow(dock, agents, dims, repeats=1, warmup=0)
    finally:
        dock.shutdown()
        for agent in agents:
            ray.kill(agent)
    (record,) = records
    assert record["warehouse_bytes"] == predicted_bytes(dims, [dims.num_samples])
    assert {state: entry["samples"] for state, entry in record["states"].items()} == {
        state: dims.num_samples for state in CONSUMES
    }
