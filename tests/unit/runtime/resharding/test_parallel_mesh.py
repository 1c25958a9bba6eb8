"""resharding/parallel_mesh.py: every group of every dimension as ranks (pure), and on gloo ranks each rank's
groups, the EP view and the groups' timeout as the mesh makes them."""

from __future__ import annotations

import itertools
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist

from rldock.runtime.resharding.parallel_mesh import DIMENSIONS, MeshShape, ParallelMesh


def test_the_groups_of_a_dp2_cp2_tp2_mesh():
    shape = MeshShape(dp=2, cp=2, tp=2, ep=2)  # rank = (d * cp + c) * tp + t
    assert shape.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.rank_groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert shape.rank_groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.rank_groups("cp_tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shape.rank_groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert shape.rank_groups("ep") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert shape.rank_groups("edp") == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert shape.rank_groups("dp_replicate") == [[rank] for rank in range(8)]  # one replica
    assert shape.rank_groups("dp_shard_cp") == shape.rank_groups("dp_cp")
    assert shape.rank_groups("pp") == [[rank] for rank in range(8)]  # one stage
    assert shape.rank_groups("pp_cp_tp") == shape.rank_groups("cp_tp")


def test_pipeline_stages_are_blocks_of_ranks_and_every_other_dimension_lies_in_one():
    shape = MeshShape(pp=2, dp=2, tp=2)  # rank = (p * dp + d) * tp + t: stage 0 is ranks 0-3
    assert shape.world == 8 and shape.stage_world == 4
    assert shape.rank_groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert shape.rank_groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert shape.rank_groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # a data-parallel rank's rows: its TP pair in each stage
    assert shape.rank_groups("pp_cp_tp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    stages = [set(range(4)), set(range(4, 8))]
    for dimension in DIMENSIONS:
        if "pp" not in dimension:
            assert all(any(set(g) <= stage for stage in stages) for g in shape.rank_groups(dimension)), dimension


def test_hsdp_replicates_over_replicas_and_shards_within_one():
    shape = MeshShape(dp=4, cp=2, replicate=2)  # d = r * 2 + s: replica 0 is d 0, 1 (ranks 0-3)
    assert shape.rank_groups("dp_shard_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shape.rank_groups("dp_replicate") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (shape.size("dp_shard_cp"), shape.size("dp_replicate")) == (4, 2)
    with pytest.raises(ValueError, match="3 replicas must divide the 4 data-parallel ranks"):
        MeshShape(dp=4, replicate=3)


@pytest.mark.parametrize(
    "shape",
    [
        MeshShape(dp=4),
        MeshShape(dp=2, cp=2, ep=4),
        MeshShape(dp=3, cp=2, tp=2, ep=3),
        MeshShape(dp=1, tp=4),
        MeshShape(dp=4, cp=2, tp=2, replicate=2),
        MeshShape(pp=2, dp=2, cp=2, ep=2),
        MeshShape(pp=4, dp=1, tp=2),
    ],
    ids=str,
)
def test_each_dimension_tiles_the_ranks_and_sizes_its_groups(shape):
    for dimension in DIMENSIONS:
        groups = shape.rank_groups(dimension)
        assert sorted(itertools.chain(*groups)) == list(range(shape.world)), dimension  # each rank once
        assert {len(group) for group in groups} == {shape.size(dimension)}, dimension
    # An EP group lies in one TP rank's sequence ranks; its members hold different shards, each shard's
    # holders are an expert-data-parallel group.
    for ep_group in shape.rank_groups("ep"):
        assert any(set(ep_group) <= set(seq) for seq in shape.rank_groups("dp_cp"))
        assert all(len(set(ep_group) & set(edp)) <= 1 for edp in shape.rank_groups("edp"))


def test_the_ep_groups_are_consecutive_sequence_ranks_as_the_contract_says():
    """rldock.contract.layout: at tp 1, EP groups of consecutive sequence ranks, CP innermost, so at ep = cp
    an EP group is a CP group and at ep = 2 cp it spans two."""
    assert MeshShape(dp=2, cp=2, ep=2).rank_groups("ep") == MeshShape(dp=2, cp=2).rank_groups("cp")
    assert MeshShape(dp=2, cp=2, ep=4).rank_groups("ep") == [[0, 1, 2, 3]]
    assert MeshShape(dp=4, ep=2).rank_groups("edp") == [[0, 2], [1, 3]]


def test_a_shape_refuses_what_does_not_tile():
    with pytest.raises(ValueError, match="EP size 3 must divide the 4 sequence ranks"):
        MeshShape(dp=2, cp=2, ep=3)
    with pytest.raises(ValueError, match="at least 1"):
        MeshShape(dp=0)
    with pytest.raises(ValueError, match="no mesh dimension 'vp'"):
        MeshShape(dp=2).rank_groups("vp")
    with pytest.raises(ValueError, match="no mesh dimension 'vp'"):
        MeshShape(dp=2).size("vp")


SHAPES = (
    MeshShape(dp=2, cp=2, ep=2),
    MeshShape(dp=2, tp=2),
    MeshShape(dp=1, cp=4, ep=4),
    MeshShape(dp=2, cp=2, replicate=2),
    MeshShape(pp=2, dp=1, tp=2),
)


def _rank(rank: int, world: int, rendezvous: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    found = {}
    for shape in SHAPES:
        mesh = ParallelMesh(shape, "cpu", timeout_s=42)
        groups = {}
        for dimension in DIMENSIONS:
            group = mesh.group(dimension)
            if group is None:
                continue
            members = dist.get_process_group_ranks(group)
            total = torch.tensor([rank])
            dist.all_reduce(total, group=group)  # the group works: the sum of its members
            timeout = group._get_backend(torch.device("cpu")).options._timeout
            groups[dimension] = (members, int(total), timeout.total_seconds(), mesh.local_rank(dimension))
        experts = mesh.experts
        ep_view = None if experts is None else (experts.sharding.rank, experts.data_parallel.size())
        found[str(shape)] = dict(groups=groups, ep_view=ep_view, fsdp=mesh.fsdp.shape)
    torch.save(found, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_on_gloo_ranks_each_rank_has_its_groups_with_the_job_s_timeout():
    world = 4
    with tempfile.TemporaryDirectory() as out:
        rank_processes.spawn(_rank, args=(world, str(Path(out) / "rendezvous"), out), nprocs=world)
        ranks = [torch.load(Path(out) / f"rank{r}.pt") for r in range(world)]
    for rank, found in enumerate(ranks):
        for shape in SHAPES:
            key = str(shape)
            groups = found[key]["groups"]
            for dimension, (members, total, timeout_s, local_rank) in groups.items():
                (expected,) = [g for g in shape.rank_groups(dimension) if rank in g]
                assert members == expected and total == sum(expected), (key, dimension)
                assert local_rank == expected.index(rank)
                # the job's timeout, not torch's 30 minutes (a group spanning every rank may be the default group)
                assert timeout_s in ((42, 60) if len(expected) == world else (42,)), (key, dimension, timeout_s)
            # the dimensions of size 1 have no group: nothing to reduce over
            assert set(groups) == {d for d in DIMENSIONS if shape.size(d) > 1 and d in _used(shape)}, key
    # The EP view: the rank's shard (its place in its EP group) and its expert-data-parallel mesh's size.
    ep2, tp2, ep4, hsdp, _ = (str(shape) for shape in SHAPES)
    assert [r[ep2]["ep_view"] for r in ranks] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r[ep4]["ep_view"] for r in ranks] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert all(r[tp2]["ep_view"] is None for r in ranks)
    # FSDP's mesh: the sequence ranks, or HSDP's 2 replicas by 2 shards
    assert [r[key]["fsdp"] for r in ranks for key in (ep2, hsdp)] == [(4,), (2, 2)] * world


def _used(shape: MeshShape) -> set[str]:
    hsdp = {"dp_replicate", "dp_shard_cp"} if shape.replicate > 1 else {"dp_shard_cp"}
    return {"tp", "cp", "dp", "cp_tp", "dp_cp", "pp", "pp_cp_tp"} | hsdp | ({"ep", "edp"} if shape.ep > 1 else set())
