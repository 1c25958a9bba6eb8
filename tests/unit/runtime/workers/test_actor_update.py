"""The actor's update and preference steps: the metrics they report and the gradients they accumulate."""

from __future__ import annotations

import types

import pytest
import torch
from tensordict import TensorDict
from tiny_models import tiny_qwen2  # tests/tiny_models.py

from rldock.config.job import JobConfig
from rldock.runtime.algorithms import get_policy_loss, masked_mean
from rldock.runtime.engines.policy import response_logprobs_and_entropy
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.training.ddp import DdpBackend
from rldock.runtime.training.policy_objective import job_objective
from rldock.runtime.workers.actor import ActorWorker


def _tiny_model():
    torch.manual_seed(0)
    return tiny_qwen2()


def _actor_double(model) -> ActorWorker:
    """An ActorWorker with only what `_optimizer_step` reads: one CPU rank, no DDP wrapper, no engine."""
    cfg = JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        training={"micro_batch_size": 2},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 3,
            "max_response_length": 3,
            "learning_rate": 1e-3,
        },
    )
    actor = ActorWorker.__new__(ActorWorker)
    actor.cfg, actor.world_size, actor.model = cfg, 1, model
    actor.backend = DdpBackend(
        cfg, model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), rank=0, world_size=1
    )
    actor.device = types.SimpleNamespace(torch_device="cpu")
    actor.recipe = job_recipe(cfg)
    actor.objective = job_objective(cfg, actor.recipe)
    return actor


def test_update_step_logs_the_token_mean_entropy_before_the_step():
    model = _tiny_model()
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4], [3, 2, 1]])  # (B, PL)
    response_ids = torch.tensor([[12, 13, 0], [14, 0, 0], [15, 16, 17], [18, 19, 0]])  # (B, SL)
    response_mask = (response_ids != 0).long()
    batch = TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": (prompt_ids != 0).long(),
            "response_ids": response_ids,
            "response_mask": response_mask,
        },
        batch_size=[4],
    )
    with torch.no_grad():
        scores = response_logprobs_and_entropy(
            model, batch["prompt_ids"], batch["prompt_mask"], response_ids, response_mask, micro_batch_size=4
        )
    batch["old_logprobs"] = scores.logprobs
    batch["ref_logprobs"] = scores.logprobs
    batch["advantage"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    expected = masked_mean(scores.entropy, response_mask)  # token mean over all 8 response tokens

    stats = _actor_double(model)._optimizer_step(batch)

    assert abs(stats["entropy"] - float(expected)) < 1e-5
    assert 0 < stats["entropy"] <= float(torch.log(torch.tensor(32.0)))


def test_freeze_embeddings_trains_the_layers_only():
    from rldock.runtime.models.freezing import freeze_embeddings

    model = _tiny_model()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    embeddings = model.get_input_embeddings().weight.detach().clone()
    layer = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    assert freeze_embeddings(model) == 32 * 32  # the tied matrix counted once
    actor = _actor_double(model)
    actor.cfg = actor.cfg.model_copy(
        update={"training": actor.cfg.training.model_copy(update={"freeze_embeddings": True})}
    )
    actor.backend.optimizer = actor._make_optimizer(model.parameters())
    held = {id(p) for group in actor.backend.optimizer.param_groups for p in group["params"]}
    assert id(model.get_input_embeddings().weight) not in held  # no AdamW state for it

    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    model(input_ids=tokens, labels=tokens).loss.backward()
    actor.backend.optimizer.step()
    assert model.get_input_embeddings().weight.grad is None
    assert torch.equal(model.get_input_embeddings().weight, embeddings)
    assert torch.equal(model.lm_head.weight, embeddings)  # still tied
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, layer)


def test_fsdp_update_step_equals_the_plain_step(tmp_path):
    """`training.strategy: fsdp` on a one-rank gloo group: the actor's update step (loss, FSDP's
    sharded gradient clipping, AdamW on the shards) gives the plain step's metrics and weights."""
    import torch.distributed as dist

    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.fsdp_sharding import full_state_dict
    from rldock.runtime.training.fsdp import FsdpBackend

    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4], [3, 2, 1]])  # (B, PL)
    response_ids = torch.tensor([[12, 13, 0], [14, 0, 0], [15, 16, 17], [18, 19, 0]])  # (B, SL)
    batch = TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": (prompt_ids != 0).long(),
            "response_ids": response_ids,
            "response_mask": (response_ids != 0).long(),
            "advantage": torch.tensor([1.0, -1.0, 0.5, -0.5]),
            "old_logprobs": torch.full((4, 3), -3.0),
            "ref_logprobs": torch.full((4, 3), -3.0),
        },
        batch_size=[4],
    )
    plain = _actor_double(_tiny_model())
    plain.recipe = job_recipe(plain.cfg)
    expected_stats = plain._optimizer_step(batch.clone())
    expected = plain.model.state_dict()

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        actor = _actor_double(_tiny_model())
        actor.cfg = actor.cfg.model_copy(
            update={"training": actor.cfg.training.model_copy(update={"strategy": "fsdp"})}
        )
        actor.backend = FsdpBackend(
            actor.cfg, model=actor.model, make_optimizer=actor._make_optimizer, device=detect_device("cpu"), rank=0
        )
        stats = actor._optimizer_step(batch.clone())
        got = dict(full_state_dict(actor.model))
    finally:
        dist.destroy_process_group()
    for key in ("loss", "grad_norm", "entropy"):
        assert abs(stats[key] - expected_stats[key]) < 1e-5, key
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_update_step_aggregates_the_whole_mini_batch_over_its_micro_batches():
    """For every algorithm.loss_aggregation, two micro-batches give the gradient of the aggregate
    (policy loss + kl_coef * KL) over the whole mini-batch computed in one piece."""
    from rldock.runtime.algorithms.aggregation import aggregate
    from rldock.runtime.algorithms.kl import kl_penalty

    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 4], [3, 2, 1]])  # (B, PL)
    response_ids = torch.tensor([[12, 13, 0], [14, 0, 0], [15, 16, 17], [18, 19, 0]])  # (B, SL)
    response_mask = (response_ids != 0).long()
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        model = _tiny_model()
        batch = TensorDict(
            {
                "prompt_ids": prompt_ids,
                "prompt_mask": (prompt_ids != 0).long(),
                "response_ids": response_ids,
                "response_mask": response_mask,
            },
            batch_size=[4],
        )
        with torch.no_grad():
            scores = response_logprobs_and_entropy(
                model, prompt_ids, batch["prompt_mask"], response_ids, response_mask, micro_batch_size=4
            )
        batch["old_logprobs"] = scores.logprobs - 0.1  # ratio e^0.1: off-policy, inside the clip
        batch["ref_logprobs"] = scores.logprobs + 0.2
        batch["advantage"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
        actor = _actor_double(model)
        actor.cfg.algorithm.loss_aggregation = mode
        actor.cfg.algorithm.max_grad_norm = 1e9  # no clipping: compare raw gradients
        actor.cfg.algorithm.recompute_old_logprobs = "always"
        actor.recipe = job_recipe(actor.cfg)
        actor.objective = job_objective(actor.cfg, actor.recipe)  # fixed at start from the config
        actor.backend.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        actor._optimizer_step(batch)
        split = [p.grad.clone() for p in model.parameters()]

        model.zero_grad()
        mask = response_mask.float()
        logprobs = response_logprobs_and_entropy(
            model, prompt_ids, batch["prompt_mask"], response_ids, response_mask, micro_batch_size=4
        ).logprobs
        policy = get_policy_loss("clipped")(
            logprobs, batch["old_logprobs"], batch["advantage"], mask, clip_ratio=0.2, aggregation=mode, norm_length=3
        )
        kl = aggregate(kl_penalty(logprobs, batch["ref_logprobs"]), mask, mode, norm_length=3)
        (policy.loss + actor.cfg.algorithm.kl_coef * kl).backward()
        for got, want in zip(split, (p.grad for p in model.parameters())):
            assert torch.allclose(got, want, atol=1e-6), mode


def test_preference_step_over_micro_batches_of_pairs_equals_the_whole_mini_batch():
    """DPO's step runs the same accumulation loop: two micro-batches of one pair each give the
    gradient and metrics of the two pairs in one micro-batch."""
    prompt_ids = torch.tensor([[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]])  # (B, PL): pairs share a prompt
    response_ids = torch.tensor([[12, 13, 0], [14, 0, 0], [15, 16, 17], [18, 19, 0]])  # (B, SL) chosen, rejected
    batch = TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": (prompt_ids != 0).long(),
            "response_ids": response_ids,
            "response_mask": (response_ids != 0).long(),
            "ref_logprobs": torch.full((4, 3), -3.0),
        },
        batch_size=[4],
    )
    results = []
    for micro_batch_size in (2, 4):
        model = _tiny_model()
        actor = _actor_double(model)
        actor.cfg = actor.cfg.model_copy(
            update={
                "training": actor.cfg.training.model_copy(update={"micro_batch_size": micro_batch_size}),
                "algorithm": actor.cfg.algorithm.model_copy(update={"max_grad_norm": 1e9}),
            }
        )
        actor.backend.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        stats = actor._preference_step(batch.clone())
        results.append((stats, [p.grad.clone() for p in model.parameters()]))
    (split, split_grads), (whole, whole_grads) = results
    assert list(split) == [
        "loss",
        "policy_loss",
        "kl",
        "entropy",
        "preference_accuracy",
        "reward_margin",
        "policy_preference_accuracy",
        "grad_norm",
    ]
    # Pair means are exact over any split; kl and entropy are each micro-batch's token mean, weighted
    # by its pairs (logged only), so they depend on the split.
    for key in (
        "loss",
        "policy_loss",
        "preference_accuracy",
        "reward_margin",
        "policy_preference_accuracy",
        "grad_norm",
    ):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    for got, want in zip(split_grads, whole_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_rank_whose_passes_repeat_its_leaders_reports_none():
    """The stages the backend runs report what this rank computed, except on a TP peer (the
    backend's counts_passes is False), whose passes the leader already counts."""
    from rldock.runtime.engines.policy import PassTally

    tally = PassTally(tokens=90, pairs=4095, head_positions=40)
    actor = ActorWorker.__new__(ActorWorker)
    actor.backend = types.SimpleNamespace(counts_passes=True)
    assert actor._computed(tally) == {"tokens": 90, "pairs": 4095, "head_positions": 40}
    actor.backend = types.SimpleNamespace(counts_passes=False)
    assert actor._computed(tally) == {"tokens": 0, "pairs": 0, "head_positions": 0}
