"""The critic worker state (PPO): one Ray actor per data-parallel rank, holding the value model.

Two stages per iteration, both through the dock: `critic_inference` writes each response token's
value (before advantages can be estimated), `critic_update` regresses the values to the returns the
advantage stage wrote, with PPO's value clipping. Ray runs an actor's calls in submission order, so
an iteration's inference is complete before its update starts.

Data parallelism mirrors the actor's (`training.data_parallel_size` critic ranks, one
torch.distributed group of their own). Under `training.strategy: ddp` each rank is a DDP replica:
inference ranks take micro-batches as they come, the update takes exactly this rank's
token-balanced share and DDP averages the gradients, so every rank holds the same weights; rank 0
writes the checkpoint, every rank loads it. Under `fsdp` the value model is sharded as the actor is
(engines/fsdp.py, with training.fsdp_cpu_offload and training.mixed_precision): forwards are
collective, so inference too takes exactly this rank's share in as many passes as every other rank;
micro-batch gradients accumulate unsynchronised and are reduce-scattered once per optimizer step;
the checkpoint is the same file, gathered whole (collective) and written by rank 0.
training.gradient_checkpointing applies under either strategy, as for the actor.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import cast

import torch
from tensordict import TensorDict
from torch.distributed import TCPStore
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from rldock.config import JobConfig
from rldock.runtime.algorithms.value_loss import clipped_value_loss
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import run_stage
from rldock.runtime.engines.distributed import Rendezvous, init_process_group, open_rendezvous, wrap_ddp
from rldock.runtime.engines.fsdp import apply_fsdp, clip_grad_norm, full_state_dict
from rldock.runtime.engines.policy import sort_by_tokens
from rldock.runtime.engines.values import response_values
from rldock.runtime.models.layers import enable_activation_checkpointing
from rldock.runtime.models.value import load_value_model
from rldock.runtime.threads import apply_thread_budget
from rldock.runtime.turns import TakesTurns, in_turn

CRITIC_FILE = "critic.pt"
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class CriticWorker(TakesTurns):
    def __init__(self, cfg: JobConfig, *, policy_dir: str, banks: DockBanks, rank: int = 0, world_size: int = 1):
        self.cfg, self.banks, self.rank, self.world_size = cfg, banks, rank, world_size
        self._group_store: TCPStore | None = None  # rank 0's listening store, from pick_rendezvous
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, device_kind=self.device.kind, role=f"critic rank {rank}")
        torch.manual_seed(cfg.seed)  # the same on every rank: the value head starts identical
        self.model = load_value_model(policy_dir, dtype=cfg.model.dtype, device=self.device.torch_device)
        if cfg.training.gradient_checkpointing:  # before any wrapper (FSDP's hooks sit outside)
            enable_activation_checkpointing(self.model)
        self.ddp_model: DistributedDataParallel | None = None  # set by join_group
        self.sharded = False  # strategy fsdp with more than one rank, set by join_group
        self.optimizer = self._make_optimizer()

    def _make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=self.cfg.algorithm.ppo.critic_learning_rate,
            weight_decay=self.cfg.algorithm.weight_decay,
        )

    # --- set-up -------------------------------------------------------------------------------

    def pick_rendezvous(self) -> Rendezvous:
        """On rank 0: open the group's store here; every rank's `join_group` gets its address."""
        rendezvous, self._group_store = open_rendezvous(self.world_size)
        return rendezvous

    def join_group(self, rendezvous: Rendezvous) -> None:
        """Form the critic ranks' process group and wrap the model in DDP or shard it with FSDP2
        (called on all ranks at once). A lone rank (data_parallel_size 1) needs no group and trains
        the bare model, as a lone FSDP actor rank holds everything anyway."""
        if self.world_size == 1:
            return
        init_process_group(
            self.device, rank=self.rank, world_size=self.world_size, rendezvous=rendezvous, store=self._group_store
        )
        training = self.cfg.training
        if training.strategy == "fsdp":
            apply_fsdp(
                self.model, self.device, cpu_offload=training.fsdp_cpu_offload, mixed_precision=training.mixed_precision
            )
            self.optimizer = self._make_optimizer()  # on the sharded parameters: 1/world of AdamW's state
            self.sharded = True
        else:
            self.ddp_model = wrap_ddp(self.model, self.device)

    # --- stages -------------------------------------------------------------------------------

    @in_turn("critic_inference")
    def compute_values(self, iteration: int) -> dict:
        micro_batch_size = self.cfg.training.micro_batch_size

        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            batch = batch.to(self.device.torch_device)
            with torch.no_grad():
                values = response_values(
                    self.model,
                    batch["prompt_ids"],
                    batch["prompt_mask"],
                    batch["response_ids"],
                    batch["response_mask"],
                    micro_batch_size=micro_batch_size,
                    trim=self.cfg.training.trim_padding,
                )  # (B, SL)
            return TensorDict({"values": values.cpu()}, batch_size=[len(indices)])

        if self.sharded:  # a collective forward: every rank runs its equal share in as many passes
            timing = run_stage(
                self.banks.bank(iteration),
                "critic_inference",
                self.banks.states["critic_inference"],
                infer,
                rank=self.rank,
                batch_size=self.cfg.num_samples_per_iteration // self.world_size,
                balance_ranks=self.world_size,
                max_batches=1,
            )
        else:
            timing = run_stage(
                self.banks.bank(iteration),
                "critic_inference",
                self.banks.states["critic_inference"],
                infer,
                rank=self.rank,
                batch_size=micro_batch_size,
            )
        return {**timing.as_dict(), "rank": self.rank}

    @in_turn("critic_update")
    def update(self, iteration: int) -> dict:
        """This rank's share of the iteration's samples (token-balanced across the critic ranks), in
        `num_updates_per_iteration` optimizer steps."""
        algo = self.cfg.algorithm
        steps: list[dict] = []
        share = self.cfg.num_samples_per_iteration // self.world_size

        def train(indices: torch.Tensor, batch: TensorDict) -> None:
            for mini_batch in batch.split(len(batch) // algo.num_updates_per_iteration):
                steps.append(self._optimizer_step(mini_batch.to(self.device.torch_device)))

        timing = run_stage(
            self.banks.bank(iteration),
            "critic_update",
            self.banks.states["critic_update"],
            train,
            rank=self.rank,
            batch_size=share,
            balance_ranks=self.world_size,
            max_batches=1,
        )
        assert timing.num_samples == share, "critic_update got a partial share"
        summary = {key: sum(step[key] for step in steps) / len(steps) for key in steps[0]}
        return {**timing.as_dict(), **summary, "rank": self.rank, "weights_sum": self.weights_sum()}

    def _optimizer_step(self, mini_batch: TensorDict) -> dict:
        """One step on a mini-batch, micro-batches weighted by their tokens: a token mean over the
        mini-batch of every rank. DDP and FSDP average gradients over ranks, so each rank scales by
        world_size / global tokens; the step is then the same however the dock split the samples."""
        algo = self.cfg.algorithm
        local_tokens = mini_batch["response_mask"].sum().float().clamp(min=1)
        global_tokens = local_tokens.clone()
        if self.world_size > 1:
            torch.distributed.all_reduce(global_tokens)
        tokens_per_rank = global_tokens / self.world_size
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"value_loss": 0.0, "value_clip_fraction": 0.0, "value_mean": 0.0}
        if self.cfg.training.trim_padding:  # similar lengths per micro-batch, so trimming cuts more
            mini_batch = mini_batch[sort_by_tokens(mini_batch)]
        micro_batches = mini_batch.split(self.cfg.training.micro_batch_size)
        model = self.model if self.ddp_model is None else self.ddp_model
        for i, micro in enumerate(micro_batches):
            mask = micro["response_mask"].float()  # (b, SL)
            last = i == len(micro_batches) - 1  # DDP/FSDP reduce the gradients on the last backward only
            if self.sharded:  # unsynchronised micro-batches keep whole gradients until the last one
                cast(FSDPModule, self.model).set_requires_gradient_sync(last)  # apply_fsdp made it one in place
            context = torch.enable_grad() if last or self.ddp_model is None else self.ddp_model.no_sync()
            with context:
                values = response_values(
                    model,
                    micro["prompt_ids"],
                    micro["prompt_mask"],
                    micro["response_ids"],
                    micro["response_mask"],
                    micro_batch_size=len(micro),
                    trim=self.cfg.training.trim_padding,
                )  # (b, SL)
                loss = clipped_value_loss(values, micro["values"], micro["returns"], mask, algo.ppo.value_clip)
                (loss.loss * (mask.sum() / tokens_per_rank)).backward()
            w = float(mask.sum() / local_tokens)  # this rank's metrics: its own token mean
            stats["value_loss"] += loss.loss.item() * w
            stats["value_clip_fraction"] += loss.clip_fraction.item() * w
            stats["value_mean"] += float((values.detach() * mask).sum() / mask.sum().clamp(min=1)) * w
        if self.sharded:  # the norm over every rank's shards
            stats["value_grad_norm"] = clip_grad_norm(self.model, algo.max_grad_norm)
        else:
            stats["value_grad_norm"] = float(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.max_grad_norm)
            )
        self.optimizer.step()
        return stats

    def weights_sum(self) -> float:
        """The sum of every parameter (in float64). DDP: each rank sums its replica, equal on every
        rank while DDP keeps them in step, so a rank that drifted shows in the metrics. FSDP: the
        shards' sums added over the ranks (collective), the whole model's sum, which a rank whose
        shards were lost or loaded wrong changes for every rank alike (one read per update)."""
        with torch.no_grad():
            if not self.sharded:
                return math.fsum(float(p.double().sum()) for p in self.model.parameters())
            total = torch.tensor(
                [math.fsum(float(_local(p).double().sum()) for p in self.model.parameters())],
                dtype=torch.float64,
                device=self.device.torch_device,
            )
            torch.distributed.all_reduce(total)
            return float(total)

    # --- checkpoint ---------------------------------------------------------------------------

    def save(self, staging_dir: str) -> None:
        """Rank 0 writes the value model and its optimizer (DDP: the ranks hold the same). FSDP:
        collective, the whole weights and optimizer state are gathered first (as the actor's
        checkpoint), so the file is the same whichever strategy wrote it; the optimizer state is
        keyed by parameter names then, where DDP's is keyed by index."""
        if self.sharded:
            state = {
                "model": dict(full_state_dict(self.model)),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=FULL),
            }
        elif self.rank == 0:
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.rank == 0:
            torch.save(state, Path(staging_dir) / CRITIC_FILE)

    def load(self, checkpoint_dir: str) -> None:
        """Every rank reads the whole file; FSDP ranks keep their own shards of it (collective)."""
        if not self.sharded:
            state = torch.load(Path(checkpoint_dir) / CRITIC_FILE, map_location=self.device.torch_device)
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            return
        state = torch.load(Path(checkpoint_dir) / CRITIC_FILE, map_location="cpu")
        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=whole)
        set_optimizer_state_dict(self.model, self.optimizer, optim_state_dict=state["optimizer"], options=whole)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP parameter (a DTensor), the tensor itself otherwise."""
    return param.to_local() if isinstance(param, DTensor) else param
