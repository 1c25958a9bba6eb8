"""`algorithm.recompute_old_logprobs: auto` is exact: with one update per iteration, taking the old
logprobs from the update's own forward pass (detached) gives the same loss, gradients and step as a
separate old-logprob pass (`always`), with the ratio exactly 1."""

from __future__ import annotations

import copy
import types

import torch
from tensordict import TensorDict
from tiny_models import tiny_qwen2  # tests/tiny_models.py

from rldock.config.job import JobConfig
from rldock.runtime.algorithms import get_policy_loss
from rldock.runtime.engines.policy import response_logprobs
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.training.ddp import DdpBackend
from rldock.runtime.training.policy_objective import job_objective
from rldock.runtime.workers.actor import ActorWorker


def _tiny_model():
    torch.manual_seed(0)
    return tiny_qwen2()


def _cfg(recompute: str) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        training={"micro_batch_size": 2},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 3,
            "max_response_length": 3,
            "learning_rate": 1e-2,
            "recompute_old_logprobs": recompute,
        },
    )


def _actor_double(model, recompute: str) -> ActorWorker:
    """An ActorWorker with only what `_optimizer_step` reads: one CPU rank, no DDP wrapper, no engine."""
    cfg = _cfg(recompute)
    actor = ActorWorker.__new__(ActorWorker)
    actor.cfg, actor.world_size, actor.model = cfg, 1, model
    actor.backend = DdpBackend(
        cfg, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), rank=0, world_size=1
    )
    actor.device = types.SimpleNamespace(torch_device="cpu")
    actor.recipe = job_recipe(cfg)
    actor.objective = job_objective(cfg, actor.recipe)
    return actor


def _batch(model) -> TensorDict:
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4], [3, 2, 1]])  # (B, PL) left-padded
    response_ids = torch.tensor([[12, 13, 0], [14, 0, 0], [15, 16, 17], [18, 19, 0]])  # (B, SL)
    batch = TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": (prompt_ids != 0).long(),
            "response_ids": response_ids,
            "response_mask": (response_ids != 0).long(),
        },
        batch_size=[4],
    )
    torch.manual_seed(1)
    with torch.no_grad():
        batch["ref_logprobs"] = (
            response_logprobs(
                model, prompt_ids, batch["prompt_mask"], response_ids, batch["response_mask"], micro_batch_size=4
            )
            + 0.1 * torch.randn(4, 3) * batch["response_mask"]
        )
    batch["advantage"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return batch


def test_auto_drops_the_old_logprob_column_and_always_keeps_it():
    assert "old_logprobs" not in job_recipe(_cfg("auto")).consumes["update"]
    assert "old_logprobs" in job_recipe(_cfg("always")).consumes["update"]


def test_auto_update_equals_always_update_on_the_same_batch():
    base = _tiny_model()
    always_model, auto_model = copy.deepcopy(base), copy.deepcopy(base)
    batch = _batch(base)
    always_batch = batch.clone()
    with torch.no_grad():  # what the actor_inference pass writes to the dock (one pass of the same weights)
        always_batch["old_logprobs"] = response_logprobs(
            always_model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            micro_batch_size=2,
        )

    always = _actor_double(always_model, "always")._optimizer_step(always_batch)
    auto = _actor_double(auto_model, "auto")._optimizer_step(batch)

    for key in ("loss", "policy_loss", "kl", "clip_fraction", "entropy", "grad_norm"):
        assert abs(always[key] - auto[key]) < 1e-6, key
    assert auto["clip_fraction"] == 0.0  # ratio exactly 1: nothing is clipped on the only step
    for (name, p_always), p_auto in zip(always_model.named_parameters(), auto_model.parameters()):
        torch.testing.assert_close(p_auto.grad, p_always.grad, rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(p_auto, p_always, rtol=0, atol=1e-6, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(auto_model.parameters(), base.parameters()))  # it stepped


def test_detached_own_logprobs_give_ratio_one_and_the_recomputed_gradient():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    advantages = torch.tensor([0.7, -1.2, 0.3])
    loss_fn = get_policy_loss("clipped")

    logprobs = torch.nn.functional.logsigmoid(logits)  # (B, T) any differentiable logprobs
    own = loss_fn(logprobs, logprobs.detach(), advantages, mask, clip_ratio=0.2)
    (own_grad,) = torch.autograd.grad(own.loss, logits)
    recomputed_old = torch.nn.functional.logsigmoid(logits.detach().clone())  # a separate pass, same weights
    other = loss_fn(torch.nn.functional.logsigmoid(logits), recomputed_old, advantages, mask, clip_ratio=0.2)
    (other_grad,) = torch.autograd.grad(other.loss, logits)

    assert float(own.ratio_mean) == 1.0 and float(own.clip_fraction) == 0.0
    assert torch.equal(own.loss, other.loss)
    torch.testing.assert_close(own_grad, other_grad, rtol=0, atol=0)
