"""The job's shape, computed once: torchtitan's `ParallelDims` for rldock.

Everything that asks "how many" of a job reads one `JobLayout`: the config checks
(rldock.config.problems), the worker-state specs and the trainer (rldock.runtime.flow.states, trainer),
the thread budget and the memory planner. Nobody multiplies the parallel sizes again.

- actor ranks: pipeline_parallel_size x data_parallel_size x context_parallel_size x tensor_parallel_size,
  one device each (a data-parallel rank's CP ranks share its samples, each computing a slice of every
  sequence; its stages each run their layers of every pass);
- expert parallelism: `ep` of the dp x cp sequence ranks split an MoE model's experts (EP groups of
  consecutive sequence ranks, CP innermost: at ep = cp an EP group is a CP group, at ep = k cp it spans
  k of them, at cp = k ep it lies inside one), dp x cp / ep ranks hold the same experts (the
  expert-data-parallel size); EP adds no ranks, it must divide dp x cp. Why across CP: the experts
  see tokens, not sequences, and every sequence rank holds distinct tokens (its data-parallel rank's
  rows, its slice of their positions), so the all-to-all dispatch is the same over any ranks, and
  carving EP from dp x cp (torchtitan's and Megatron's folding) lets a job with few DP ranks still
  split its experts;
- generation replicas: `generation_tp` consecutive actor ranks each, one vLLM engine on the
  replica's first rank (its engine rank) whose TP workers span the replica's devices;
- the other device worker groups (reference, critic, reward model, or a group a new worker state
  brings): each as many ranks as its `RankCount` says;
- devices: those the resources give (nodes x devices per node) and those the placement plan
  (rldock.contract.placement) needs to seat every worker, with each device's seats in SEAT_ORDER.

Pure and config-free, like the rest of the contract: rldock.config.job_layout builds one from a
JobConfig, naming the device groups the config counts; the runtime names those its worker-state
specs run (tests/unit/runtime/flow/test_states.py holds the two plans equal).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Literal

from rldock.contract.placement import PlacementMode, PlacementPlan, SeatRequest, plan_placement

# How many ranks a worker group runs: one per actor rank (PP x DP x CP x TP), one per sequence rank of each
# pipeline stage (PP x DP x CP, `num_stage_sequence_ranks`: the reference and the critic run their passes with
# the actor's stages and CP), one per sequence rank (DP x CP, `num_sequence_ranks`), or one.
RankCount = Literal["actor_ranks", "stage_sequence_ranks", "sequence_ranks", "one"]


def stage_layer_counts(num_layers: int, stages: int) -> list[int]:
    """The decoder layers of each pipeline stage (training.pipeline_parallel_size): num_layers // stages,
    one more on each of the first num_layers % stages (the last holds the LM head). The runtime's split and
    the memory planner both read it."""
    base, spare = divmod(num_layers, stages)
    return [base + (stage < spare) for stage in range(stages)]


@dataclass(frozen=True)
class DeviceGroup:
    """A device worker group besides the actor ranks: its name in the placement plan, how many
    ranks, and whether two of them must sit on distinct devices (a collective group)."""

    name: str
    ranks: RankCount = "one"
    distinct: bool = False


@dataclass(frozen=True)
class JobLayout:
    """One job's parallel sizes, devices and device worker groups (module docstring)."""

    dp: int  # training.data_parallel_size
    tp: int = 1  # training.tensor_parallel_size
    cp: int = 1  # training.context_parallel_size
    ep: int = 1  # training.expert_parallel_size: sequence ranks (dp x cp) that split the experts
    pp: int = 1  # training.pipeline_parallel_size: stages, each of dp x cp x tp ranks
    generation_tp: int = 1  # rollout.tensor_parallel_size: actor ranks per generation replica
    num_nodes: int = 1
    devices_per_node: int = 1
    placement: PlacementMode = "colocated"
    accelerator: str = "NPU"  # the Ray resource of one device
    groups: tuple[DeviceGroup, ...] = ()  # the device worker groups besides the actor's

    def __post_init__(self) -> None:
        sizes = {"dp": self.dp, "tp": self.tp, "cp": self.cp, "ep": self.ep, "pp": self.pp}
        sizes["generation_tp"] = self.generation_tp
        sizes |= {"num_nodes": self.num_nodes, "devices_per_node": self.devices_per_node}
        small = [f"{name}={value}" for name, value in sizes.items() if value < 1]
        if small:
            raise ValueError(f"a job layout's sizes are at least 1, got {', '.join(small)}")

    @property
    def num_actor_ranks(self) -> int:
        """Actor ranks: every data-parallel rank's context- and tensor-parallel peers in every pipeline stage,
        one device each."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def num_sequence_ranks(self) -> int:
        """Ranks that hold a whole model replica's passes over distinct positions: DP x CP (what FSDP
        shards over within a stage, the actor's and the critic's)."""
        return self.dp * self.cp

    @property
    def num_stage_sequence_ranks(self) -> int:
        """Ranks that run a model's passes split into the actor's pipeline stages and over its CP ranks, without
        TP: PP x DP x CP (the reference's and the critic's)."""
        return self.pp * self.num_sequence_ranks

    @property
    def experts_divide(self) -> bool:
        """Whether the EP groups tile the dp x cp sequence ranks (the config checks refuse a job where not)."""
        return self.num_sequence_ranks % self.ep == 0

    @property
    def expert_data_parallel(self) -> int:
        """Ranks that hold the same experts: dp x cp / ep. Raises ValueError unless `ep` divides dp x cp."""
        if not self.experts_divide:
            raise ValueError(
                f"training.expert_parallel_size={self.ep} must divide the {self.num_sequence_ranks} sequence ranks "
                f"(data_parallel_size {self.dp} x context_parallel_size {self.cp})"
            )
        return self.num_sequence_ranks // self.ep

    def num_ranks(self, count: RankCount) -> int:
        return {
            "actor_ranks": self.num_actor_ranks,
            "stage_sequence_ranks": self.num_stage_sequence_ranks,
            "sequence_ranks": self.num_sequence_ranks,
            "one": 1,
        }[count]

    def group_ranks(self, name: str) -> int:
        """The ranks of device group `name`; 0 for a group the job does not run."""
        return sum(self.num_ranks(group.ranks) for group in self.groups if group.name == name)

    @property
    def num_device_workers(self) -> int:
        """Worker processes that hold a device share: the actor ranks and every group's ranks."""
        return self.num_actor_ranks + sum(self.num_ranks(group.ranks) for group in self.groups)

    @property
    def generation_divides(self) -> bool:
        """Whether the actor ranks split into whole generation replicas (the config checks refuse
        a job where they do not)."""
        return self.num_actor_ranks % self.generation_tp == 0

    @property
    def num_generation_replicas(self) -> int:
        """Generation replicas (vLLM engines). Raises ValueError unless `generation_tp` divides the
        actor ranks."""
        if not self.generation_divides:
            raise ValueError(
                f"rollout.tensor_parallel_size={self.generation_tp} must divide the {self.num_actor_ranks} actor ranks"
            )
        return self.num_actor_ranks // self.generation_tp

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        """The actor ranks that hold a rollout engine: each generation replica's first rank."""
        return tuple(range(0, self.num_generation_replicas * self.generation_tp, self.generation_tp))

    @property
    def num_devices(self) -> int:
        """The devices the resources give: nodes x devices per node."""
        return self.num_nodes * self.devices_per_node

    def seat_requests(self) -> tuple[SeatRequest, ...]:
        """The groups' ranks as the placement plan seats them (in SEAT_ORDER there)."""
        return tuple(SeatRequest(g.name, self.num_ranks(g.ranks), distinct=g.distinct) for g in self.groups)

    @cached_property
    def plan(self) -> PlacementPlan:
        """Every device worker's seat: actor rank i on device i, the groups first fit after them."""
        return plan_placement(
            accelerator=self.accelerator,
            num_actor_ranks=self.num_actor_ranks,
            others=self.seat_requests(),
            mode=self.placement,
        )

    @property
    def num_devices_needed(self) -> int:
        return self.plan.num_devices

    def seats_on(self, device: int) -> list[str]:
        """The workers on one device in seat order, e.g. ['actor 0', 'reference 0']."""
        return self.plan.workers_on(device)

    def with_data_parallel_size(self, dp: int) -> JobLayout:
        """The same job at another data-parallel size (the planner plans one DP rank)."""
        return replace(self, dp=dp)
