"""Context parallelism for a trained model (`training.context_parallel_size`): the CP groups, the
model's attention switched to the CP mode's (`training.context_parallel_mode`: Ulysses or ring,
engines/context_attention.py), and its gradients summed over CP.

Ranks: the default group's world is dp x cp ranks, CP innermost: rank `d cp + c` is CP rank c of
data-parallel rank d, and the cp consecutive ranks of one data-parallel rank share their rows (each
computes 1/cp of every sequence). The CP group sits inside the data-parallel dimension: FSDP shards
over all dp x cp ranks, so the parameters, gradients and optimizer state per rank fall by dp x cp.
Under TP the world is dp x cp x tp, TP innermost (the training mesh, resharding/parallel_mesh.py): a
CP group is the ranks of one TP rank, so it attends with that rank's 1/tp of the heads, and the cp x tp
ranks of a data-parallel rank share its rows.

Gradients: a CP rank's gradient is its positions' share of its data-parallel rank's gradient (every
rank of the group computes the same loss), so the step's gradient is the sum over each CP group
averaged over the dp groups: a reduction over all ranks divided by dp, not by dp x cp
(`sum_over_context`).

Samples: a data-parallel rank's rows are read once, by its CP group's first rank, as DP rank d of dp
(token-balanced over the dp groups), and broadcast to the group (backend.py's `run_shared_stage`);
each CP rank then cuts its slice of every sequence inside the pass (engines/ulysses.py's
`shard_forward`). Why whole rows and not the dock's rows pre-split along the sequence: a pass's
sequence is only known inside the pass (packing lays several rows' tokens into one sequence with its
own 4D mask, trimming cuts the padding), the loss needs every position's logprob on every rank of the
group anyway (`sum_over_group`), and the rows are token ids, small next to the activations CP divides.

Losses and metrics: every rank of a CP group computes the same loss from the same summed logprobs,
so the group reports one loss (cp equal copies: a mean over ranks is the mean over the dp groups).
A loss normalised by a sum over all ranks divided by the world (the token mean's units) counts each
group's rows cp times over dp x cp ranks, i.e. the mean over the dp groups, as without CP. A
constant normaliser (seq_mean_token_sum_norm's length) is divided by dp, not the world
(policy_steps.rank_units): by the world it would scale the step cp times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from rldock.runtime.dock.stage_loop import StageFn, StageResult, StageSpec
from rldock.runtime.engines.context_attention import apply_context_attention
from rldock.runtime.engines.expert_parallel import ExpertParallelExperts
from rldock.runtime.resharding.parallel_mesh import ParallelMesh
from rldock.runtime.training.backend import run_shared_stage

if TYPE_CHECKING:
    from rldock.runtime.dock import TransferDock


def apply_context_parallel(model: nn.Module, mesh: ParallelMesh, mode: str = "ulysses") -> dist.ProcessGroup | None:
    """Give `model` the attention of `mode` (`ulysses` or `ring`, engines/context_attention.py) over this
    rank's CP group of `mesh` (None and nothing done at cp 1): the ranks of its TP rank in the other CP
    ranks, so a CP group exchanges the same 1/tp of the heads. Call after the TP plan (the attention then
    runs on a TP rank's heads) and before the training backend wraps the model."""
    group = mesh.group("cp")
    if group is not None:
        apply_context_attention(model, group, mode, tp=mesh.size("tp"))
    return group


def sum_over_context(model: nn.Module, *, dp: int) -> None:
    """Make FSDP's gradient reduction over the dp x cp ranks divide by dp: a sum over each CP group,
    a mean over the data-parallel ranks (module docstring). Call after `fully_shard`.

    The reduction is a plain sum then a division: FSDP would otherwise reduce in float32 and bfloat16
    with a pre-multiplied sum (its factor is not the world), which gloo refuses (and HCCL has not),
    while a float64 model took the sum path anyway (why the float64 ranks test did not see it).
    Expert-parallel experts are left alone: they scale their own gradients by 1 / dp and FSDP sums
    them (engines/fsdp_sharding.py)."""
    for module in model.modules():
        if isinstance(module, FSDPModule) and not isinstance(module, ExpertParallelExperts):
            module.set_gradient_divide_factor(float(dp))
            module.set_force_sum_reduction_for_comms(True)


@dataclass(frozen=True)
class ContextLayout:
    """One rank's place in the dp x cp (x tp, x pp) ranks (module docstring): the group that shares its
    data-parallel rank's rows (its CP, TP and PP peers; None when it has none), the data-parallel size and
    rank, and the group's reader (global)."""

    cp: int
    dp: int
    dp_rank: int
    reader: int
    group: dist.ProcessGroup | None

    @classmethod
    def of(cls, model: nn.Module, *, mesh: ParallelMesh, mode: str = "ulysses") -> ContextLayout:
        """Give `model` the CP attention of `mode` over this rank's CP group of `mesh`
        (`apply_context_parallel`) and say where the rank sits. Before FSDP wraps the model. With TP and PP in
        the mesh, a data-parallel rank's rows are its pp x cp x tp ranks' (`pp_cp_tp`): they share one read,
        by the last stage's first rank (the stage that scores them, training/pipeline.py)."""
        apply_context_parallel(model, mesh, mode)
        group = mesh.group("pp_cp_tp")
        ranks = [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)
        return cls(
            cp=mesh.size("cp"),
            dp=mesh.size("dp"),
            dp_rank=mesh.local_rank("dp"),
            reader=ranks[-mesh.size("cp_tp")],  # the group lists its ranks stage by stage
            group=group,
        )

    @classmethod
    def alone(cls, *, rank: int, world_size: int) -> ContextLayout:
        """Rank `rank` of `world_size` at cp 1, with or without a default group: it reads for itself."""
        return cls(cp=1, dp=world_size, dp_rank=rank, reader=rank, group=None)

    def sum_gradients(self, model: nn.Module) -> None:
        """FSDP's reduction a sum over CP, a mean over DP (`sum_over_context`); nothing at cp 1."""
        if self.cp > 1:
            sum_over_context(model, dp=self.dp)

    def run_share(
        self, dock: TransferDock, spec: StageSpec, fn: StageFn, *, batch_size: int, whole_groups: bool = False
    ) -> StageResult:
        """Exactly one batch of `batch_size`, this data-parallel rank's token-balanced share, read by
        the group's reader and run by every rank of the group (module docstring)."""
        return run_shared_stage(
            dock,
            spec,
            fn,
            group=self.group,
            reader=self.reader,
            dp_rank=self.dp_rank,
            batch_size=batch_size,
            balance_ranks=self.dp,
            max_batches=1,
            whole_groups=whole_groups,
        )

    def run_all(self, dock: TransferDock, spec: StageSpec, fn: StageFn, *, batch_size: int) -> StageResult:
        """Batches of `batch_size` until the iteration's samples are exhausted, read as this
        data-parallel rank by the group's reader and run by every rank of the group: a pass that
        needs no equal shares (the reference's, workers/reference.py)."""
        return run_shared_stage(
            dock, spec, fn, group=self.group, reader=self.reader, dp_rank=self.dp_rank, batch_size=batch_size
        )
