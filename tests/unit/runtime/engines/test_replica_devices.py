"""The visible devices each generation replica's engine rank gets (rldock.runtime.engines.replica_devices)."""

from __future__ import annotations

import pytest

from rldock.runtime.engines.replica_devices import RankDevice, engine_environments, visible_ids


def _ranks(kind: str, devices: list[str], nodes: list[str] | None = None) -> list[RankDevice]:
    nodes = nodes or ["node-a"] * len(devices)
    return [RankDevice(node_id=node, device_kind=kind, device_ids=(device,)) for node, device in zip(nodes, devices)]


@pytest.mark.parametrize(("kind", "variable"), [("npu", "ASCEND_RT_VISIBLE_DEVICES"), ("cuda", "CUDA_VISIBLE_DEVICES")])
def test_each_engine_rank_sees_its_replica_with_its_own_device_first(kind, variable):
    # Ray's ids need not follow rank order: rank 0 on device 5, its peer on 2, and so on.
    ranks = _ranks(kind, ["5", "2", "7", "0"])
    assert engine_environments(ranks, generation_tp=2) == {0: {variable: "5,2"}, 2: {variable: "7,0"}}
    assert engine_environments(ranks, generation_tp=4) == {0: {variable: "5,2,7,0"}}


def test_nothing_changes_at_generation_tp_1_or_on_the_cpu():
    assert engine_environments(_ranks("npu", ["0", "1"]), generation_tp=1) == {}
    assert engine_environments(_ranks("cpu", ["0", "1"]), generation_tp=2) == {}


def test_a_replica_spanning_nodes_is_refused_naming_the_fields():
    ranks = _ranks("npu", ["0", "1", "0", "1"], nodes=["a", "a", "a", "b"])
    with pytest.raises(ValueError, match=r"ranks 2\.\.3: .*several nodes.*resources.devices_per_node"):
        engine_environments(ranks, generation_tp=2)


@pytest.mark.parametrize(
    ("ranks", "match"),
    [
        (_ranks("npu", ["3", "3"]), "share devices"),
        ([RankDevice("a", "npu", ("0", "1")), RankDevice("a", "npu", ("2",))], "exactly one device id"),
        ([RankDevice("a", "cuda", ()), RankDevice("a", "cuda", ("2",))], "accelerator_resource must be NPU"),
    ],
)
def test_layouts_an_engine_cannot_use_are_refused(ranks, match):
    with pytest.raises(ValueError, match=match):
        engine_environments(ranks, generation_tp=2)


def test_ids_of_another_accelerator_resource_are_not_this_kinds_devices():
    assert visible_ids("npu", "NPU", ["3"]) == ("3",)
    assert visible_ids("cuda", "GPU", ["0"]) == ("0",)
    assert visible_ids("cuda", "NPU", ["0"]) == ()  # NPU ids must not become CUDA_VISIBLE_DEVICES
    assert visible_ids("cpu", "NPU", ["1"]) == ("1",)  # the CPU writes no variable; ids pass through
    ranks = [RankDevice("n", "cuda", visible_ids("cuda", "NPU", [str(i)])) for i in range(2)]
    with pytest.raises(ValueError, match="resources.accelerator_resource"):
        engine_environments(ranks, generation_tp=2)
