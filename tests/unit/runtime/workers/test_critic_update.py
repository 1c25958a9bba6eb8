"""The critic's update on one rank (the DDP backend's world of one, as a lone critic rank trains):
the step equals one computed by hand over the whole mini-batch, and a checkpoint restores the
weights and the optimizer state so that the next update is the same as without the round trip."""

from __future__ import annotations

import math
import string

import pytest
import torch
from dock_doubles import OneBatchDock
from numerics import EPS32, assert_close_reordered, reordered_atol
from tensordict import TensorDict

from rldock.config.job import JobConfig
from rldock.runtime.engines.values import response_values
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import CRITIC, StageCall
from rldock.runtime.models.tiny import build_tiny_model
from rldock.runtime.models.value import load_value_model
from rldock.runtime.training.ddp import DdpBackend
from rldock.runtime.workers.critic import CriticWorker

VALUE_CLIP, MAX_GRAD_NORM, LEARNING_RATE, WEIGHT_DECAY, ADAM_EPS = 0.2, 0.05, 1e-2, 0.1, 1e-3
HIDDEN_SIZE, INTERMEDIATE_SIZE, NUM_LAYERS, NUM_TOKENS = 32, 512, 2, 4 * (3 + 3)  # the batch: 4 x (PL + SL)
# The longest chain of float32 sums behind a gradient element (tests/numerics.py): the batch's tokens
# (a weight's gradient), and per layer the backward pass crosses, its MLP's and its attention's widths.
GRADIENT_TERMS = NUM_TOKENS + NUM_LAYERS * (INTERMEDIATE_SIZE + HIDDEN_SIZE)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    # 40 tokens (36 characters and 4 special ones): the batches' ids stay below 20
    texts = [string.ascii_lowercase + string.digits]
    return build_tiny_model(
        tmp_path_factory.mktemp("policy"),
        texts=texts,
        seed=0,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_layers=NUM_LAYERS,
        num_heads=1,
        num_kv_heads=1,
    )


def _cfg(policy_dir) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": str(policy_dir)},
        resources={"device": "cpu"},
        # two micro-batches of two samples: the step accumulates them; threads left as they are
        training={"micro_batch_size": 2, "num_threads": 0},
        algorithm={
            "name": "ppo",
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 3,
            "max_response_length": 3,
            "learning_rate": 1e-3,
            "max_grad_norm": MAX_GRAD_NORM,
            "weight_decay": WEIGHT_DECAY,
            "ppo": {"critic_learning_rate": LEARNING_RATE, "value_clip": VALUE_CLIP},
        },
    )


def _random_head(model) -> None:
    """A head that predicts something (the new one predicts 0), the same in every model it is given."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=generator))
        model.head.bias.fill_(0.1)


def _batch(model, seed: int) -> TensorDict:
    """A critic_update batch: returns near the model's own values; the old values of every other
    token 0.5 above them, past VALUE_CLIP, so the clipped error is the larger one there."""
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4], [3, 2, 1]])  # (B, PL) left-padded
    response_ids = torch.tensor([[12, 13, 0], [14, 0, 0], [15, 16, 17], [18, 19, 0]])  # (B, SL)
    prompt_mask, response_mask = (prompt_ids != 0).long(), (response_ids != 0).long()
    with torch.no_grad():
        values = response_values(model, prompt_ids, prompt_mask, response_ids, response_mask, micro_batch_size=4)
    offsets = 0.5 * (torch.arange(values.numel()).reshape(values.shape) % 2)  # (B, SL)
    returns = values + 0.1 * torch.randn(values.shape, generator=generator)  # (B, SL)
    return TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "values": (values + offsets) * response_mask,
            "returns": returns * response_mask,
            "value_mask": response_mask.clone(),  # GAE by token: every model token's value trains
        },
        batch_size=[4],
    )


def _dock(batch: TensorDict) -> OneBatchDock:
    return OneBatchDock(batch)  # the critic asks it for its recipe's columns


def _critic(policy_dir, batch: TensorDict | None = None) -> CriticWorker:
    critic = CriticWorker(
        _cfg(policy_dir),
        recipe=job_recipe(_cfg(policy_dir)),
        policy_dir=str(policy_dir),
        banks=_dock(batch) if batch is not None else None,
    )
    _random_head(critic.model)
    return critic


def _adamw(params) -> torch.optim.Optimizer:
    """The critic's AdamW with an eps at which the first step is well conditioned in the gradient:
    with the usual 1e-8 a gradient element near 0 moves its weight by up to lr / eps times its
    rounding error, and the critic's two micro-batches round differently from one whole batch (one
    weight in 10^4 off by 1e-6 here). tests/ranks/test_fsdp_ranks.py's `_adamw` says more."""
    return torch.optim.AdamW(params, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)


def test_the_critic_step_equals_the_hand_computed_one(policy_dir):
    reference = load_value_model(policy_dir, dtype="float32", device="cpu")
    _random_head(reference)
    batch = _batch(reference, seed=1)
    critic = _critic(policy_dir, batch)
    assert type(critic.backend) is DdpBackend and critic.backend.ddp_model is None  # a lone rank: bare model
    critic.backend.optimizer = _adamw(critic.model.parameters())

    stats = critic.update(StageCall(1))

    # By hand, over the whole mini-batch at once: 0.5 * max((V - R)^2, (V_clip - R)^2), token mean.
    mask = batch["response_mask"].float()  # (B, SL)
    values = response_values(
        reference,
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["response_ids"],
        batch["response_mask"],
        micro_batch_size=4,
    )  # (B, SL)
    old, returns = batch["values"], batch["returns"]
    clipped = old + (values - old).clamp(-VALUE_CLIP, VALUE_CLIP)
    unclipped_error, clipped_error = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * (torch.maximum(unclipped_error, clipped_error) * mask).sum() / mask.sum()
    clip_fraction = ((clipped_error > unclipped_error).float() * mask).sum() / mask.sum()
    assert 0 < clip_fraction < 1  # both branches of the max are exercised
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad**2).sum() for p in reference.parameters()))
    assert grad_norm > MAX_GRAD_NORM  # so the clipping is exercised too
    torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
    _adamw(reference.parameters()).step()

    assert stats.metrics["value_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert stats.metrics["value_clip_fraction"] == pytest.approx(float(clip_fraction), rel=1e-6)
    assert stats.metrics["value_mean"] == pytest.approx(float((values.detach() * mask).sum() / mask.sum()), rel=1e-5)
    assert stats.metrics["value_grad_norm"] == pytest.approx(float(grad_norm), rel=1e-5)
    assert stats.num_samples == 4  # the whole iteration: one rank's share
    stepped = dict(critic.model.named_parameters())
    for name, param in reference.named_parameters():  # the clipped gradients the step took, and the step
        assert_close_reordered(stepped[name].grad, param.grad, num_terms=GRADIENT_TERMS, msg=name)
        # AdamW's first step moves a weight by lr * g / (|g| + eps): a gradient off by d moves it by at
        # most lr / eps * d more; the step's own few roundings of the weight add a few eps of its scale.
        step_atol = LEARNING_RATE / ADAM_EPS * reordered_atol(param.grad, num_terms=GRADIENT_TERMS)
        weight_atol = step_atol + 4 * EPS32 * float(param.detach().abs().max())
        torch.testing.assert_close(
            stepped[name], param, rtol=0.0, atol=weight_atol, msg=lambda found, name=name: f"{name}: {found}"
        )
    assert stats.metrics["weights_sum"] == pytest.approx(
        math.fsum(float(p.detach().double().sum()) for p in reference.parameters())
    )


def test_a_checkpoint_round_trip_keeps_the_next_update(policy_dir, tmp_path):
    first = _batch(load_value_model(policy_dir, dtype="float32", device="cpu"), seed=1)
    critic = _critic(policy_dir, first)
    critic.update(StageCall(1))
    assert critic.save(str(tmp_path)) is None  # no state of a rank's own (rng.pt)
    assert CRITIC.checkpoint is not None  # the files its spec declares, and no other
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(CRITIC.checkpoint.files)

    resumed = CriticWorker(
        _cfg(policy_dir), recipe=job_recipe(_cfg(policy_dir)), policy_dir=str(policy_dir), banks=None
    )  # a zero head, fresh AdamW
    resumed.restore(str(tmp_path), None)
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    saved, loaded = critic.backend.optimizer.state_dict(), resumed.backend.optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for index, per_param in saved["state"].items():
        for key, value in per_param.items():
            assert torch.equal(loaded["state"][index][key], value), (index, key)

    # AdamW's moments decide the next step: equal weights after it only if they came back too.
    second = _batch(critic.model, seed=2)
    critic.banks, resumed.banks = _dock(second), _dock(second.clone())
    kept, restored = critic.update(StageCall(2)), resumed.update(StageCall(2))
    for name, tensor in critic.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    assert restored.metrics["value_loss"] == kept.metrics["value_loss"]
    assert restored.metrics["weights_sum"] == kept.metrics["weights_sum"]
