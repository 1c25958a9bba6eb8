"""The policy's optimizer steps on one mini-batch, written once for every training backend: the
policy-gradient step (the job's objective, training/policy_objective.py) and DPO's preference step
(algorithms/dpo.py), each accumulating micro-batches of the policy's scores
(engines/policy_passes.py) through `accumulate`. The update stage's pass over a rank's share is
`train_share` (accumulation.py); the steps here are what it runs on each mini-batch."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.algorithms.aggregation import additive_units
from rldock.runtime.algorithms.dpo import PreferenceObjective
from rldock.runtime.engines.policy import PassTally
from rldock.runtime.engines.policy_passes import micro_batch_scores, update_micro_batches
from rldock.runtime.flow.columns import PARTIAL_ROLLOUT
from rldock.runtime.models.router_loss import RouterLoss
from rldock.runtime.models.routing_replay import pass_listeners, replaying_batch
from rldock.runtime.training.accumulation import accumulate
from rldock.runtime.training.backend import TrainingBackend
from rldock.runtime.training.policy_objective import PolicyObjective

SAMPLED_LOGPROBS, _ = PARTIAL_ROLLOUT  # the engine's logprob of each sampled token


def policy_step(
    backend: TrainingBackend,
    mini_batch: TensorDict,
    objective: PolicyObjective,
    *,
    cfg: JobConfig,
    world_size: int,
    tally: PassTally | None = None,
) -> dict[str, float]:
    """One optimizer step over a mini-batch (on the model's device), accumulating micro-batches
    (training.micro_batch_size rows, within training.micro_batch_tokens when set); the loss aggregated
    over the whole mini-batch of every rank by algorithm.loss_aggregation (the token mean by default).
    `tally` adds up what the forward passes computed."""
    training = cfg.training
    rank_tokens = mini_batch["response_mask"].sum().float().clamp(min=1)  # this rank's metrics' weights
    global_units = objective.units(mini_batch)
    additive = additive_units(objective.aggregation)
    if world_size > 1 and additive:
        torch.distributed.all_reduce(global_units)
    units_per_rank = rank_units(
        global_units,
        additive=additive,
        world_size=world_size,
        rows_shared_by=training.pipeline_parallel_size * training.context_parallel_size * training.tensor_parallel_size,
    )

    router = RouterLoss(backend.model, coef=training.router_aux_loss_coef)  # MoE: the router's terms
    largest_deviation: list[float] = []  # per micro-batch, max |ratio - 1| over its sampled tokens

    def micro_loss(micro: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
        share = len(micro) / len(mini_batch)
        # replay's hooks first, so the router terms count the experts the pass used
        with replaying_batch(backend.model, micro) as replay, router.recording(backend.training_module()) as routing:
            listeners = pass_listeners(replay, routing)  # under CP both need each pass's own tokens
            scores = micro_batch_scores(backend.training_module(), micro, training, tally=tally, routes=listeners)
        loss, metrics = objective(
            scores.logprobs, scores.entropy, micro, units_per_rank=units_per_rank, rank_tokens=rank_tokens
        )
        if "old_logprobs" in micro.keys():
            spread = ratio_spread(
                scores.logprobs.detach(), micro["old_logprobs"], micro["response_mask"], rank_tokens=float(rank_tokens)
            )
            largest_deviation.append(spread.pop("ratio_abs_dev_max"))
            metrics |= spread
        if SAMPLED_LOGPROBS in micro.keys():  # rollout.return_logprobs: the training-inference mismatch
            gap = (scores.logprobs.detach() - micro[SAMPLED_LOGPROBS]).abs() * micro["response_mask"]
            metrics["rollout_logprob_abs_diff_mean"] = float(gap.sum()) / float(rank_tokens)
        if replay is not None:
            metrics |= {key: value * share for key, value in replay.metrics().items()}
        return router.add(loss, metrics, routing, share=share)

    rows = update_micro_batches(backend.training_module(), mini_batch, training)
    micro_batches = [mini_batch[r] for r in rows]
    stats = accumulate(backend, micro_batches, micro_loss, max_grad_norm=cfg.algorithm.max_grad_norm)
    if largest_deviation:
        stats["ratio_abs_dev_max"] = max(largest_deviation)
    return stats


def rank_units(units: torch.Tensor, *, additive: bool, world_size: int, rows_shared_by: int) -> torch.Tensor:
    """What each rank divides its micro-batches' numerators by, so the gradient reduction over the
    ranks (a sum over each CP group, a mean over the data-parallel groups: training/context_parallel.py)
    gives the whole mini-batch's aggregate. `rows_shared_by`: the ranks that hold one data-parallel
    rank's rows, pp x cp x tp (a TP group's ranks compute one loss, as a CP group's and a pipeline's
    stages do). `units`: additive units already summed over the `world_size` ranks (that sum counts
    each row rows_shared_by times, and dividing by the world leaves the total over the dp groups), or
    the constant of a non-additive mode (the normalising length), which is shared by the dp = world /
    rows_shared_by groups only: dividing it by the world would scale every rank's loss, and the step's
    gradient, rows_shared_by times."""
    ranks = world_size if additive else max(world_size // rows_shared_by, 1)
    return units.clamp(min=torch.finfo(units.dtype).tiny) / ranks


def ratio_spread(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, *, rank_tokens: float
) -> dict[str, float]:
    """How far a micro-batch's update logprobs (b, SL) of the sampled tokens are from their old logprobs
    (b, SL) where `mask` (b, SL) is 1: its part of the mini-batch's token means (its tokens' sums over
    the mini-batch's `rank_tokens`, so accumulate's sum over micro-batches is the mean) of (ratio - 1)^2
    (`ratio_sq_dev_mean`; its root is the importance ratio's spread about 1) and of |logprob - old
    logprob| (`logprob_abs_diff_mean`), and its largest |ratio - 1| (`ratio_abs_dev_max`). With routing
    replay on and off, these say what replay changes in an MoE's ratio."""
    valid = mask.bool()
    diff = (logprobs - old_logprobs)[valid].double()  # (n,)
    deviation = torch.expm1(diff)  # ratio - 1
    return {
        "ratio_sq_dev_mean": float((deviation**2).sum()) / rank_tokens,
        "logprob_abs_diff_mean": float(diff.abs().sum()) / rank_tokens,
        "ratio_abs_dev_max": float(deviation.abs().max()) if diff.numel() else 0.0,
    }


def preference_step(
    backend: TrainingBackend, mini_batch: TensorDict, *, cfg: JobConfig, tally: PassTally | None = None
) -> dict[str, float]:
    """One optimizer step on the DPO loss over a mini-batch of whole pairs (on the model's device),
    accumulating micro-batches of whole pairs (an even micro_batch_size, problems.py). The loss is a
    mean over pairs; every rank holds as many pairs, so DDP's mean over ranks is the global pair mean.
    `tally` adds up what the forward passes computed."""
    algo = cfg.algorithm
    objective = PreferenceObjective(
        beta=algo.dpo.beta,
        label_smoothing=algo.dpo.label_smoothing,
        kl_estimator=algo.kl_estimator,
        kl_clamp=algo.kl_clamp,
    )

    def micro_loss(micro: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
        scores = micro_batch_scores(backend.training_module(), micro, cfg.training, tally=tally)
        return objective(scores.logprobs, scores.entropy, micro, share=len(micro) / len(mini_batch))

    micro_batches = mini_batch.split(cfg.training.micro_batch_size)
    return accumulate(backend, micro_batches, micro_loss, max_grad_norm=algo.max_grad_norm)


def staleness_metrics(staleness: list[torch.Tensor]) -> dict[str, float]:
    """`staleness_mean` / `staleness_max` of an update from its samples' staleness (B,) each: policy
    versions between the samples and the policy the update started from (0 on-policy, 1 for the
    async pipeline's samples)."""
    values = torch.cat(staleness).float()  # (B,)
    return {"staleness_mean": float(values.mean()), "staleness_max": float(values.max())}
