"""The critic worker state (PPO): one Ray actor per critic rank, holding the value model.

Two stages per iteration, both through the dock: `critic_inference` writes each response token's
value (before advantages can be estimated), `critic_update` regresses the values to the returns the
advantage stage wrote, with PPO's value clipping. Ray runs an actor's calls in submission order, so
an iteration's inference is complete before its update starts.

Its ranks mirror the actor's without TP (the job layout's stage sequence ranks: PP x DP x CP, one
torch.distributed group of their own), and the critic trains through the same training backends as the actor
(rldock.runtime.training), applied to the value model in `join_group`: the job's layout without TP
(training/strategies.py's `data_parallel_strategy_of`: DDP replicas, or FSDP2 shards with
training.fsdp_cpu_offload, training.mixed_precision, CP and pipeline stages; the value model is never
TP-split, whatever training.tensor_parallel_size says of the policy). Under training.pipeline_parallel_size
> 1 each rank loads its stage of the value model alone and links it to the actor's other stages
(training/pipeline.py's `split_stage`, models/value.py's `stage_parts`), its inference streams through them
and its update runs them on 1F1B, as the policy's do: a data-parallel rank's rows are read by its last
stage's first rank, which alone holds the head and writes the values; the other stages' values and losses
are zeros and their metrics the last stage's. The backend deals each stage's samples (inference as the
layout's forward needs them, the update exactly this rank's token-balanced share), accumulates the
micro-batches (`accumulate`; under FSDP their gradients are reduce-scattered once per step,
`defer_gradient_sync`), steps, and gathers and reshards the checkpoint: the same `critic.pt` (the whole
value model, every stage's layers under the whole model's names) and `critic_optimizer.pt` whichever layout
wrote them, read whole by every rank on resume, each keeping its stage's part. A lone rank (one critic rank)
joins no group and trains the bare model. training.gradient_checkpointing applies under every layout, as for
the actor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.checkpoint import CRITIC_FILE, CRITIC_OPTIMIZER_FILE
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.engines.policy import PassTally, response_attention
from rldock.runtime.engines.process_group import Rendezvous
from rldock.runtime.engines.values import response_values
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import CRITIC_INFERENCE, CRITIC_UPDATE, StageCall
from rldock.runtime.models.layers import enable_activation_checkpointing
from rldock.runtime.models.value import load_value_model
from rldock.runtime.training.accumulation import train_share
from rldock.runtime.training.backend import TrainingBackend, load_full_weights
from rldock.runtime.training.checksum import weights_sum
from rldock.runtime.training.group import TrainingGroup
from rldock.runtime.training.pipeline import rank_stage
from rldock.runtime.training.value_step import value_step
from rldock.runtime.workers.phase_keeper import TakesTurns, in_turn
from rldock.runtime.workers.threads import apply_thread_budget


class CriticWorker(TakesTurns):
    def __init__(
        self, cfg: JobConfig, *, recipe: Recipe, policy_dir: str, banks: DockBanks, rank: int = 0, world_size: int = 1
    ):
        self.cfg, self.banks, self.rank, self.world_size = cfg, banks, rank, world_size
        self.recipe = recipe  # the job's (job_recipe): the columns its two states read
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, recipe, device_kind=self.device.kind, role=f"critic rank {rank}")
        torch.manual_seed(cfg.seed)  # the same on every rank: the value head starts identical
        stage = rank_stage(cfg.training, rank=rank, world_size=world_size)  # its stage's weights alone under PP
        self.model = load_value_model(policy_dir, dtype=cfg.model.dtype, device=self.device.torch_device, stage=stage)
        if cfg.training.gradient_checkpointing:  # before any wrapper (FSDP's hooks sit outside)
            enable_activation_checkpointing(self.model)
        self.group = TrainingGroup(cfg, device=self.device, rank=rank, world_size=world_size)
        # A world of one running the bare model; join_group applies the layout to a larger one.
        self.backend: TrainingBackend = self.group.alone(self.model, self._make_optimizer)

    def _make_optimizer(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params,
            lr=self.cfg.algorithm.ppo.critic_learning_rate,
            weight_decay=self.cfg.algorithm.weight_decay,
        )

    # --- set-up -------------------------------------------------------------------------------

    def pick_rendezvous(self) -> Rendezvous:
        """On rank 0: open the group's store here; every rank's `join_group` gets its address."""
        return self.group.pick_rendezvous()

    def join_group(self, rendezvous: Rendezvous) -> None:
        """Form the critic ranks' process group and apply the training layout to the value model
        (called on all ranks at once; the optimizer is built on the parameters as the layout holds
        them; under PP the model is cut to this rank's stage first). A lone rank (one critic rank)
        needs no group and trains the bare model, as a lone FSDP actor rank holds everything anyway."""
        if self.world_size == 1:
            return
        self.backend = self.group.join(
            rendezvous,
            self.model,
            self._make_optimizer,
            data_parallel_only=True,  # the value model is never TP-split (its stages are the actor's)
            # One gradient synchronisation per step (the memory planner counts the whole gradients
            # this keeps under FSDP: planning/memory.py).
            defer_gradient_sync=True,
        )

    # --- stages -------------------------------------------------------------------------------

    @in_turn(CRITIC_INFERENCE)
    def compute_values(self, call: StageCall) -> StageResult:
        tally = PassTally()

        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            batch = batch.to(self.device.torch_device)
            with torch.no_grad():
                values = response_values(
                    self.model,
                    batch["prompt_ids"],
                    batch["prompt_mask"],
                    batch["response_ids"],
                    batch["response_mask"],
                    micro_batch_size=self.cfg.training.micro_batch_size,
                    trim=self.cfg.training.trim_padding,
                    attention_mask=response_attention(batch),
                    tally=tally,
                )  # (B, SL)
            return TensorDict({"values": values.cpu()}, batch_size=[len(indices)])

        timing = self.backend.run_inference_stage(
            self.banks.bank(call.iteration), self.recipe.spec(CRITIC_INFERENCE.name), infer
        )
        return timing.with_metrics(rank=self.rank, computed=tally.as_dict(counts=self.backend.counts_passes))

    @in_turn(CRITIC_UPDATE)
    def update(self, call: StageCall) -> StageResult:
        """This rank's share of the iteration's samples (token-balanced across the critic ranks), in
        `num_updates_per_iteration` optimizer steps."""
        tally = PassTally()
        timing, summary = train_share(
            self.backend,
            self.banks.bank(call.iteration),
            self.recipe.spec(CRITIC_UPDATE.name),
            lambda mini_batch: self._optimizer_step(mini_batch, tally),
            num_mini_batches=self.cfg.algorithm.num_updates_per_iteration,
        )
        stage = self.backend.pipeline
        return timing.with_metrics(
            **summary,
            rank=self.rank,
            weights_sum=weights_sum(self.model, stages=None if stage is None else stage.links.group),
            computed=tally.as_dict(counts=self.backend.counts_passes),
        )

    def _optimizer_step(self, mini_batch: TensorDict, tally: PassTally | None = None) -> dict[str, float]:
        """One value-regression step on a mini-batch (training/value_step.py)."""
        batch = mini_batch.to(self.device.torch_device)
        return value_step(self.backend, batch, cfg=self.cfg, world_size=self.world_size, tally=tally)

    # --- checkpoint ---------------------------------------------------------------------------

    def save(self, staging_dir: str) -> None:
        """The critic's checkpoint state (flow/states.py: CRITIC.checkpoint): rank 0 writes the whole value
        model and the backend its optimizer state (DDP: rank 0's, every rank's being the same; FSDP: gathered
        whole first, every stage's under PP, collective, so the model file is the same whichever layout wrote
        it). It returns no state of a rank's own for rng.pt."""
        staging = Path(staging_dir)
        with self.backend.resident():
            weights = self.backend.full_weights()  # None: this rank holds the whole model already
            self.backend.save_optimizer(staging / CRITIC_OPTIMIZER_FILE)
        if self.rank == 0:
            torch.save(self.model.state_dict() if weights is None else weights, staging / CRITIC_FILE)

    def restore(self, checkpoint_dir: str, rank_state: None = None) -> None:
        """Every rank reads the whole files and keeps its own part of them (its stage's under PP;
        collective where sharded); `rank_state`: None, the critic keeps none."""
        checkpoint = Path(checkpoint_dir)
        load_full_weights(self.backend, torch.load(checkpoint / CRITIC_FILE, map_location="cpu"))
        self.backend.load_optimizer(checkpoint / CRITIC_OPTIMIZER_FILE, map_location=self.device.torch_device)
