"""The reference worker state: frozen initial policy, writes the logprobs the KL term compares to.

Its PP x DP x CP ranks (the job layout's stage sequence ranks) hold the frozen model, each whole at PP 1. At
CP 1 and PP 1 each reads its own batches. Under context or pipeline parallelism
(`training.context_parallel_size` or `pipeline_parallel_size` > 1) the ranks form a process group of their
own (`join_group`, a process beside each actor rank's, since a process holds one default group), laid out as
the actor's ranks are without TP (pp outermost): the model, loaded as the rank's pipeline stage alone, is
linked to the others as the actor's is (training/pipeline.py's `split_stage`, the passes streaming through
the stages) and gets the CP mode's attention over its CP group (training/context_parallel.py's
`ContextLayout`). A data-parallel rank's pp x cp ranks share its batches: the last stage's first rank reads
each and broadcasts it, every rank computes its stage's layers over its 1/cp of each sequence, and the
reader writes the logprobs back. What CP divides here: a no-grad pass keeps no activations between layers,
but a layer's working set and the LM head's logits (positions x vocabulary) scale with the positions a rank
computes; PP divides the weights.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.engines.policy import PassTally
from rldock.runtime.engines.policy_passes import batch_logprobs
from rldock.runtime.engines.process_group import Rendezvous
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import REFERENCE_INFERENCE, StageCall
from rldock.runtime.models.loading import load_causal_lm
from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh
from rldock.runtime.training.context_parallel import ContextLayout
from rldock.runtime.training.group import TrainingGroup
from rldock.runtime.training.pipeline import rank_stage, split_stage
from rldock.runtime.workers.phase_keeper import TakesTurns, in_turn
from rldock.runtime.workers.threads import apply_thread_budget


class ReferenceWorker(TakesTurns):
    def __init__(
        self, cfg: JobConfig, *, recipe: Recipe, rank: int, reference_dir: str, banks: DockBanks, world_size: int = 1
    ):
        self.cfg, self.rank, self.world_size, self.banks = cfg, rank, world_size, banks
        self.spec = recipe.spec(REFERENCE_INFERENCE.name)  # the dock columns it reads, as the job runs it
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, recipe, device_kind=self.device.kind, role=f"reference rank {rank}")
        stage = rank_stage(cfg.training, rank=rank, world_size=world_size)  # its stage's weights alone under PP
        self.model = load_causal_lm(reference_dir, dtype=cfg.model.dtype, device=self.device.torch_device, stage=stage)
        self.model.eval().requires_grad_(False)
        # Each rank reads for itself until `join_group` (CP > 1) gives it a CP group.
        self.context = ContextLayout.alone(rank=rank, world_size=world_size)
        self.group = TrainingGroup(cfg, device=self.device, rank=rank, world_size=world_size)

    # --- set-up (CP or PP > 1 only: flow/states.py's REFERENCE joins a group then) -------------

    def pick_rendezvous(self) -> Rendezvous:
        """On rank 0: open the group's store here; every rank's `join_group` gets its address."""
        return self.group.pick_rendezvous()

    def join_group(self, rendezvous: Rendezvous) -> None:
        """Form the reference ranks' process group, cut the model to this rank's pipeline stage and give it
        the CP mode's attention over this rank's CP group (called on all ranks at once)."""
        self.group.form(rendezvous)
        training = self.cfg.training
        cp, pp = training.context_parallel_size, training.pipeline_parallel_size
        device = torch.device(self.device.torch_device)
        mesh = ParallelMesh(MeshShape(dp=self.group.world_size // (pp * cp), cp=cp, pp=pp), device.type)
        split_stage(self.model, mesh, dtype=next(self.model.parameters()).dtype, device=device)
        self.context = ContextLayout.of(self.model, mesh=mesh, mode=training.context_parallel_mode)

    # --- the stage ----------------------------------------------------------------------------

    @in_turn(REFERENCE_INFERENCE)
    def compute_ref_logprobs(self, call: StageCall) -> StageResult:
        tally = PassTally()

        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            with torch.no_grad():
                batch = batch.to(self.device.torch_device)
                logprobs = batch_logprobs(self.model, batch, self.cfg.training, tally=tally)
            return TensorDict({"ref_logprobs": logprobs.cpu()}, batch_size=[len(indices)])

        timing = self.context.run_all(
            self.banks.bank(call.iteration), self.spec, infer, batch_size=self.cfg.training.micro_batch_size
        )
        return timing.with_metrics(rank=self.rank, computed=tally.as_dict())
