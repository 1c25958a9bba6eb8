"""The critic's optimizer step on one mini-batch, written once for every training backend and layout (DDP,
FSDP, CP, pipeline stages): PPO's clipped value loss (algorithms/value_loss.py) on the value model's
passes (engines/values.py), micro-batches accumulated through `accumulate`. The critic's update stage
(workers/critic.py) runs it on each mini-batch of its share, as the actor runs training/policy_steps.py's."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.algorithms.value_loss import clipped_value_loss
from rldock.runtime.engines.policy import PassTally, response_attention, sort_by_tokens
from rldock.runtime.engines.values import response_values, valued_tokens
from rldock.runtime.training.accumulation import accumulate
from rldock.runtime.training.backend import TrainingBackend


def value_step(
    backend: TrainingBackend,
    mini_batch: TensorDict,
    *,
    cfg: JobConfig,
    world_size: int,
    tally: PassTally | None = None,
) -> dict[str, float]:
    """One step on a mini-batch (on the model's device), micro-batches weighted by their tokens: a token
    mean over the mini-batch of every rank. The layouts average gradients over data-parallel ranks, so
    each rank scales by world_size / global tokens (a CP or pipeline peer counts its data-parallel rank's
    tokens again in both); the step is then the same however the dock split the samples. `tally` adds up
    what the forward passes computed. Returns the metrics (this rank's token means; a pipeline's, its last
    stage's) and `value_grad_norm`."""
    algo = cfg.algorithm
    local_tokens = valued_tokens(mini_batch).sum().float().clamp(min=1)
    global_tokens = local_tokens.clone()
    if world_size > 1:
        dist.all_reduce(global_tokens)
    tokens_per_rank = global_tokens / world_size
    if cfg.training.trim_padding:  # similar lengths per micro-batch, so trimming cuts more
        mini_batch = mini_batch[sort_by_tokens(mini_batch)]

    def micro_loss(micro: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
        mask = valued_tokens(micro).float()  # (b, SL): the steps' values (GAE's unit)
        values = response_values(
            backend.training_module(),
            micro["prompt_ids"],
            micro["prompt_mask"],
            micro["response_ids"],
            micro["response_mask"],
            micro_batch_size=len(micro),
            trim=cfg.training.trim_padding,
            attention_mask=response_attention(micro),
            tally=tally,
        )  # (b, SL)
        loss = clipped_value_loss(values, micro["values"], micro["returns"], mask, algo.ppo.value_clip)
        w = float(mask.sum() / local_tokens)  # this rank's metrics: its own token mean
        return loss.loss * (mask.sum() / tokens_per_rank), {
            "value_loss": loss.loss.item() * w,
            "value_clip_fraction": loss.clip_fraction.item() * w,
            "value_mean": float((values.detach() * mask).sum() / mask.sum().clamp(min=1)) * w,
        }

    stats = accumulate(
        backend, mini_batch.split(cfg.training.micro_batch_size), micro_loss, max_grad_norm=algo.max_grad_norm
    )
    stats["value_grad_norm"] = stats.pop("grad_norm")
    return stats
