"""One mesh for a training group's ranks: every process group that training, its logprob passes and
resharding use comes from `ParallelMesh`, one world DeviceMesh made once per group, on every rank alike,
its dimensions named and its groups given the job's collective timeout (DEFAULT_GROUP_TIMEOUT_S; the
groups torch makes for a mesh's dimensions otherwise wait torch's default 30 minutes).

Ranks: the group's world is pp x dp x cp x tp ranks, TP innermost, then CP, PP outermost (torchtitan's
`ParallelDims` order): rank = ((p dp + d) cp + c) tp + t for pipeline stage p, data-parallel rank d, CP
rank c and TP rank t. So a TP group is tp consecutive ranks (the links a TP matmul's every layer crosses
are the shortest), a data-parallel rank's CP ranks are consecutive too (at tp 1), and a stage's ranks are
a block of dp x cp x tp (a stage's FSDP gathers stay inside it; only activations cross stages).

The dimensions (`MeshShape.rank_groups` lists every group of each; a rank belongs to one of each). Every
dimension but the two with `pp` in their name lies inside one pipeline stage:
- `pp`: the ranks of one (d, c, t), one per stage: the pipeline's activations and their gradients
  (training/pipeline.py);
- `pp_cp_tp`: the pp x cp x tp ranks of one d, which hold a data-parallel rank's rows (its last stage's
  first rank reads them from the dock and shares them with the rest: the last stage scores them);
- `tp`: the ranks of one (d, c): a TP plan's DTensors and its per-head gradient sums;
- `cp`: the ranks of one (d, t): context-parallel attention and its gradient sums;
- `dp`: the ranks of one (c, t): the TP layout's gradient averaging;
- `cp_tp`: the cp x tp ranks of one d in one stage;
- `dp_cp`, the sequence ranks: the dp x cp ranks of one t, what FSDP shards over (CP sits inside data
  parallelism: a CP group's ranks hold distinct positions of the same rows);
- `fsdp`, what FSDP2 shards over: the sequence ranks, or under HSDP (`replicate` > 1: the data-parallel
  ranks split into `replicate` replicas of dp / replicate, d = r dp / replicate + s) a 2-D mesh of
  `dp_replicate` (the ranks of one (s, c, t), which all-reduce their shards' gradients) by `dp_shard_cp`
  (the dp / replicate x cp ranks of one (r, t), which shard the model as FSDP does), torchtitan's HSDP;
- `ep` and `edp`, expert parallelism folded into the sequence ranks: the dp x cp ranks of one t,
  in order, cut into EP groups of ep consecutive ranks, each rank holding expert shard j (its place in
  its EP group); the ranks that hold the same shard are an expert-data-parallel (`edp`) group, which
  FSDP shards the experts over. (rldock.contract.layout says why EP is carved from dp x cp.)

The sub-meshes share one root, which FSDP2 over TP's DTensors needs (torchtitan's `ParallelDims` builds its
mesh the same way).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

DIMENSIONS = ("tp", "cp", "dp", "cp_tp", "dp_cp", "dp_replicate", "dp_shard_cp", "ep", "edp", "pp", "pp_cp_tp")
DEFAULT_GROUP_TIMEOUT_S = 300.0  # joining a group and each collective


@dataclass(frozen=True)
class MeshShape:
    """The sizes of a training group's mesh: pp stages of dp x cp x tp ranks, ep of a stage's dp x cp
    sequence ranks splitting the experts, the dp ranks in `replicate` replicas that FSDP shards the model
    within (HSDP)."""

    dp: int
    cp: int = 1
    tp: int = 1
    ep: int = 1
    replicate: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.cp, self.tp, self.ep, self.replicate, self.pp) < 1:
            raise ValueError(f"mesh sizes are at least 1, got {self}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"the EP size {self.ep} must divide the {self.dp * self.cp} sequence ranks (dp x cp)")
        if self.dp % self.replicate:
            raise ValueError(f"the {self.replicate} replicas must divide the {self.dp} data-parallel ranks")

    @property
    def stage_world(self) -> int:
        """The ranks of one pipeline stage: dp x cp x tp."""
        return self.dp * self.cp * self.tp

    @property
    def world(self) -> int:
        return self.pp * self.stage_world

    def size(self, dimension: str) -> int:
        """How many ranks each group of `dimension` holds."""
        sequence = self.dp * self.cp
        sizes = {
            "tp": self.tp,
            "cp": self.cp,
            "dp": self.dp,
            "cp_tp": self.cp * self.tp,
            "dp_cp": sequence,
            "dp_replicate": self.replicate,
            "dp_shard_cp": sequence // self.replicate,
            "ep": self.ep,
            "edp": sequence // self.ep,
            "pp": self.pp,
            "pp_cp_tp": self.pp * self.cp * self.tp,
        }
        if dimension not in sizes:
            raise ValueError(f"no mesh dimension {dimension!r}; one of {', '.join(DIMENSIONS)}")
        return sizes[dimension]

    def rank_groups(self, dimension: str) -> list[list[int]]:
        """Every group of `dimension` as its ranks, in a fixed order (module docstring): stage by stage for the
        dimensions inside a stage."""
        stage = self.stage_world
        if dimension == "pp":
            return [[p * stage + r for p in range(self.pp)] for r in range(stage)]
        if dimension == "pp_cp_tp":
            shared = self.cp * self.tp  # a data-parallel rank's ranks in one stage, consecutive
            return [[p * stage + d * shared + r for p in range(self.pp) for r in range(shared)] for d in range(self.dp)]
        inside = self._stage_groups(dimension)
        return [[p * stage + r for r in group] for p in range(self.pp) for group in inside]

    def _stage_groups(self, dimension: str) -> list[list[int]]:
        """The groups of `dimension` in stage 0 (every stage's are these shifted by its first rank)."""
        dp, cp, tp, ep = self.dp, self.cp, self.tp, self.ep

        def rank(d: int, c: int, t: int) -> int:
            return (d * cp + c) * tp + t

        def sequence_ranks(t: int) -> list[int]:  # the dp x cp ranks of TP rank t, d-major
            return [rank(d, c, t) for d in range(dp) for c in range(cp)]

        if dimension == "tp":
            return [[rank(d, c, t) for t in range(tp)] for d in range(dp) for c in range(cp)]
        if dimension == "cp":
            return [[rank(d, c, t) for c in range(cp)] for d in range(dp) for t in range(tp)]
        if dimension == "dp":
            return [[rank(d, c, t) for d in range(dp)] for c in range(cp) for t in range(tp)]
        if dimension == "cp_tp":
            return [[rank(d, c, t) for c in range(cp) for t in range(tp)] for d in range(dp)]
        if dimension == "dp_cp":
            return [sequence_ranks(t) for t in range(tp)]
        shard = dp // self.replicate  # a replica's data-parallel ranks
        if dimension == "dp_replicate":
            return [
                [rank(r * shard + s, c, t) for r in range(self.replicate)]
                for s in range(shard)
                for c in range(cp)
                for t in range(tp)
            ]
        if dimension == "dp_shard_cp":
            return [
                sequence_ranks(t)[r * shard * cp : (r + 1) * shard * cp]
                for r in range(self.replicate)
                for t in range(tp)
            ]
        if dimension == "ep":
            return [sequence_ranks(t)[i : i + ep] for t in range(tp) for i in range(0, dp * cp, ep)]
        if dimension == "edp":
            return [sequence_ranks(t)[j::ep] for t in range(tp) for j in range(ep)]
        raise ValueError(f"no mesh dimension {dimension!r}; one of {', '.join(DIMENSIONS)}")


@dataclass(frozen=True)
class ExpertSharding:
    """This rank's place in expert parallelism: its EP group, its rank and the group's size."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def local_experts(self, num_experts: int) -> range:
        """The experts this rank holds: a contiguous E/ep of them."""
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


@dataclass(frozen=True)
class ExpertMesh:
    """Expert parallelism on this rank: its sharding and the mesh of its expert-data-parallel group
    (the ranks holding the same experts), which FSDP shards them over."""

    sharding: ExpertSharding
    data_parallel: DeviceMesh


class ParallelMesh:
    """This rank's place in one world DeviceMesh of pp x replicate x dp / replicate x cp x tp ranks (named
    "pp", "dp_replicate", "dp_shard", "cp", "tp"), its data-parallel ranks flattened into "dp", its sequence ranks into
    "dp_cp" and, with expert parallelism, those unflattened into ("edp", "ep"): sub-meshes of one root mesh, as
    FSDP2 needs its mesh and a DTensor's to be (module docstring); `fsdp` is FSDP2's. Collective: every rank of
    the default group (a world of `shape.world` ranks) builds it, with the same shape."""

    def __init__(self, shape: MeshShape, device_type: str, *, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> None:
        world = dist.get_world_size()
        if world != shape.world:
            raise ValueError(f"a mesh of {shape.world} ranks ({shape}) over a group of {world}")
        self.shape, self.device_type = shape, device_type
        replicate, shard = shape.replicate, shape.dp // shape.replicate
        root = init_device_mesh(
            device_type,
            (shape.pp, replicate, shard, shape.cp, shape.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        sequence = root["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        self._meshes: dict[str, DeviceMesh] = {
            "tp": root["tp"],
            "cp": root["cp"],
            "dp": root["dp_replicate", "dp_shard"]._flatten("dp"),
            "dp_cp": sequence,
            "cp_tp": root["cp", "tp"]._flatten("cp_tp"),
            "dp_replicate": root["dp_replicate"],
            "dp_shard_cp": root["dp_shard", "cp"]._flatten("dp_shard_cp"),
            "pp": root["pp"],
            "pp_cp_tp": root["pp", "cp", "tp"]._flatten("pp_cp_tp"),
        }
        # FSDP2's mesh: 2-D (replicate, shard) is HSDP; one replica is FSDP over the sequence ranks
        self.fsdp = root["dp_replicate", "dp_shard_cp"] if replicate > 1 else sequence
        if shape.ep > 1:
            experts = sequence._unflatten(0, (shape.size("edp"), shape.ep), ("edp", "ep"))
            self._meshes |= {"ep": experts["ep"], "edp": experts["edp"]}
        # The groups torch made for the sub-meshes wait 30 minutes for a lost peer: the job's timeout instead
        # (the default group's is the job's already). Gloo and NCCL take a new one; other backends keep theirs.
        timeout = timedelta(seconds=timeout_s)
        for mesh in self._meshes.values():
            group = mesh.get_group()
            if mesh.size() > 1 and group is not dist.group.WORLD and dist.get_backend(group) in ("gloo", "nccl"):
                dist.distributed_c10d._set_pg_timeout(timeout, group)

    def size(self, dimension: str) -> int:
        return self.shape.size(dimension)

    def group(self, dimension: str) -> dist.ProcessGroup | None:
        """This rank's group of `dimension`; None where the dimension has size 1 (nothing to reduce), and for
        `ep` and `edp` without expert parallelism."""
        if dimension not in self._meshes or self.size(dimension) == 1:
            return None
        return self._meshes[dimension].get_group()

    def local_rank(self, dimension: str) -> int:
        """This rank's place in its group of `dimension` (0 at size 1)."""
        return self._meshes[dimension].get_local_rank() if dimension in self._meshes else 0

    def device_mesh(self, dimension: str) -> DeviceMesh:
        """This rank's group of `dimension` as a one-dimensional DeviceMesh (FSDP's and DTensor's)."""
        if dimension not in self._meshes:
            raise ValueError(f"the mesh {self.shape} has no {dimension!r} dimension: its EP size is 1")
        return self._meshes[dimension]

    @property
    def experts(self) -> ExpertMesh | None:
        """Expert parallelism's view of the mesh; None at ep 1."""
        if self.shape.ep == 1:
            return None
        sharding = ExpertSharding(group=self.group("ep"), rank=self.local_rank("ep"), size=self.shape.ep)
        return ExpertMesh(sharding=sharding, data_parallel=self.device_mesh("edp"))
