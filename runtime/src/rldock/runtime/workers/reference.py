"""The reference worker state: frozen initial policy, writes the logprobs the KL term compares to."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult, run_stage
from rldock.runtime.engines.policy import PassTally
from rldock.runtime.engines.policy_passes import batch_logprobs
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import REFERENCE_INFERENCE, StageCall
from rldock.runtime.models.loading import load_causal_lm
from rldock.runtime.workers.phase_keeper import TakesTurns, in_turn
from rldock.runtime.workers.threads import apply_thread_budget


class ReferenceWorker(TakesTurns):
    def __init__(self, cfg: JobConfig, *, recipe: Recipe, rank: int, reference_dir: str, banks: DockBanks):
        self.cfg, self.rank, self.banks = cfg, rank, banks
        self.spec = recipe.spec(REFERENCE_INFERENCE.name)  # the dock columns it reads, as the job runs it
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, recipe, device_kind=self.device.kind, role=f"reference rank {rank}")
        self.model = load_causal_lm(reference_dir, dtype=cfg.model.dtype, device=self.device.torch_device)
        self.model.eval().requires_grad_(False)

    @in_turn(REFERENCE_INFERENCE)
    def compute_ref_logprobs(self, call: StageCall) -> StageResult:
        micro_batch_size = self.cfg.training.micro_batch_size
        tally = PassTally()

        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            with torch.no_grad():
                batch = batch.to(self.device.torch_device)
                logprobs = batch_logprobs(self.model, batch, self.cfg.training, tally=tally)
            return TensorDict({"ref_logprobs": logprobs.cpu()}, batch_size=[len(indices)])

        timing = run_stage(
            self.banks.bank(call.iteration), self.spec, infer, rank=self.rank, batch_size=micro_batch_size
        )
        return timing.with_metrics(computed=tally.as_dict())
