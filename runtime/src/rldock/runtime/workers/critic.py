"""The critic worker state (PPO): one Ray actor holding the value model, on its own device share.

Two stages per iteration, both through the dock: `critic_inference` writes each response token's
value (before advantages can be estimated), `critic_update` regresses the values to the returns the
advantage stage wrote, with PPO's value clipping. Ray runs an actor's calls in submission order, so
an iteration's inference is complete before its update starts. One rank, no data parallelism: the
critic of the demo is as small as the policy; a DP critic would mirror the actor's DDP set-up.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.algorithms.value_loss import clipped_value_loss
from rldock.runtime.device import detect_device
from rldock.runtime.dock import TransferDock
from rldock.runtime.engines.policy import sort_by_tokens
from rldock.runtime.models.value import load_value_model, response_values
from rldock.runtime.threads import apply_thread_budget
from rldock.runtime.turns import TakesTurns, in_turn
from rldock.runtime.workers.stage_loop import run_stage

CRITIC_FILE = "critic.pt"


class CriticWorker(TakesTurns):
    def __init__(self, cfg: JobConfig, *, policy_dir: str, dock: TransferDock):
        self.cfg, self.dock = cfg, dock
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, device_kind=self.device.kind, role="critic")
        torch.manual_seed(cfg.seed)
        self.model = load_value_model(policy_dir, dtype=cfg.model.dtype, device=self.device.torch_device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.algorithm.ppo.critic_learning_rate,
                                           weight_decay=cfg.algorithm.weight_decay)

    @in_turn("critic_inference")
    def compute_values(self, iteration: int) -> dict:
        micro_batch_size = self.cfg.training.micro_batch_size

        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            batch = batch.to(self.device.torch_device)
            with torch.no_grad():
                values = response_values(self.model, batch["prompt_ids"], batch["prompt_mask"],
                                         batch["response_ids"], batch["response_mask"],
                                         micro_batch_size=micro_batch_size,
                                         trim=self.cfg.training.trim_padding)  # (B, SL)
            return TensorDict({"values": values.cpu()}, batch_size=[len(indices)])

        return run_stage(self.dock.bank(iteration), "critic_inference", self.dock.states["critic_inference"], infer,
                         rank=0, batch_size=micro_batch_size).as_dict()

    @in_turn("critic_update")
    def update(self, iteration: int) -> dict:
        """All of the iteration's samples, in `num_updates_per_iteration` optimizer steps."""
        algo = self.cfg.algorithm
        steps: list[dict] = []

        def train(indices: torch.Tensor, batch: TensorDict) -> None:
            for mini_batch in batch.split(len(batch) // algo.num_updates_per_iteration):
                steps.append(self._optimizer_step(mini_batch.to(self.device.torch_device)))

        timing = run_stage(self.dock.bank(iteration), "critic_update", self.dock.states["critic_update"], train, rank=0,
                           batch_size=self.cfg.num_samples_per_iteration, max_batches=1)
        summary = {key: sum(step[key] for step in steps) / len(steps) for key in steps[0]}
        return {**timing.as_dict(), **summary}

    def _optimizer_step(self, mini_batch: TensorDict) -> dict:
        """One step on a mini-batch, micro-batches weighted by their tokens (a token mean overall)."""
        algo = self.cfg.algorithm
        total_tokens = mini_batch["response_mask"].sum().float().clamp(min=1)
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"value_loss": 0.0, "value_clip_fraction": 0.0, "value_mean": 0.0}
        if self.cfg.training.trim_padding:  # similar lengths per micro-batch, so trimming cuts more
            mini_batch = mini_batch[sort_by_tokens(mini_batch)]
        for micro in mini_batch.split(self.cfg.training.micro_batch_size):
            mask = micro["response_mask"].float()  # (b, SL)
            weight = mask.sum() / total_tokens
            values = response_values(self.model, micro["prompt_ids"], micro["prompt_mask"], micro["response_ids"],
                                     micro["response_mask"], micro_batch_size=len(micro),
                                     trim=self.cfg.training.trim_padding)  # (b, SL)
            loss = clipped_value_loss(values, micro["values"], micro["returns"], mask, algo.ppo.value_clip)
            (loss.loss * weight).backward()
            w = float(weight)
            stats["value_loss"] += loss.loss.item() * w
            stats["value_clip_fraction"] += loss.clip_fraction.item() * w
            stats["value_mean"] += float((values.detach() * mask).sum() / mask.sum().clamp(min=1)) * w
        stats["value_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                                        algo.max_grad_norm))
        self.optimizer.step()
        return stats

    # --- checkpoint ---------------------------------------------------------------------------

    def save(self, staging_dir: str) -> None:
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                   Path(staging_dir) / CRITIC_FILE)

    def load(self, checkpoint_dir: str) -> None:
        state = torch.load(Path(checkpoint_dir) / CRITIC_FILE, map_location=self.device.torch_device)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
