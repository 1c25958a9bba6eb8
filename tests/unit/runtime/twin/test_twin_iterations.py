"""One GRPO and one PPO iteration's training stages with the actor, reference and critic models on
distinct devices of the npu twin (npu:0, npu:1, npu:2): every stage must move what it reads from the
dock (host memory) to its device, as on Ascend. On the CPU every `.to(device)` is a no-op, so a
missing one goes unseen; on the twin it fails as on hardware.

The workers are the product's (ActorWorker, ReferenceWorker, CriticWorker, built by their own
__init__ on `resources.device: npu`), run in this process on a dock double; the rollout is taken
as given (fixed responses), the advantage is filled in (host-only math), and the engine is a weight
sink double: generation on the twin is vLLM's CPU engine (rldock.runtime.device.TWIN_SUBSTITUTES).
"""

from __future__ import annotations

import torch
from twin_doubles import ColumnDock, WeightSinkEngine, rollout_batch

from rldock.config.job import JobConfig
from rldock.runtime.device import detect_device
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import StageCall
from rldock.runtime.workers.actor import ActorWorker
from rldock.runtime.workers.critic import CriticWorker
from rldock.runtime.workers.reference import ReferenceWorker

G, N, PL, SL = 2, 2, 4, 3


def _cfg(model_dir, algorithm: str) -> JobConfig:
    extra = {"ppo": {"critic_learning_rate": 1e-3}} if algorithm == "ppo" else {}
    return JobConfig(
        iterations=1,
        model={"path": str(model_dir)},
        resources={"device": "npu"},
        training={"micro_batch_size": 2},
        algorithm={
            "name": algorithm,
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": PL,
            "max_response_length": SL,
            "learning_rate": 1e-3,
            "kl_coef": 0.01,
            "recompute_old_logprobs": "always",
            **extra,
        },
    )


def _place(worker, index: int) -> None:
    """Move a worker to npu:index (in a Ray job each rank sees its own device as npu:0)."""
    worker.device = detect_device("npu", index=index)
    worker.model.to(worker.device.torch_device)


def _actor(cfg, model_dir, dock) -> ActorWorker:
    actor = ActorWorker(cfg, recipe=job_recipe(cfg), rank=0, world_size=1, policy_dir=str(model_dir), banks=dock)
    _place(actor, 0)
    actor.backend.optimizer = actor._make_optimizer(actor.model.parameters())
    actor.generation.engine = WeightSinkEngine()
    return actor


def _assert_stepped_on(model, device: str, before: dict) -> None:
    assert {p.device for p in model.parameters()} == {torch.device(device)}
    assert any(not torch.equal(p.detach().cpu(), before[name]) for name, p in model.named_parameters())


def test_grpo_iteration_on_the_twin(npu_twin, twin_model_dir):
    cfg = _cfg(twin_model_dir, "grpo")
    dock = ColumnDock(rollout_batch(), states={})
    actor = _actor(cfg, twin_model_dir, dock)
    reference = ReferenceWorker(cfg, recipe=job_recipe(cfg), rank=0, reference_dir=str(twin_model_dir), banks=dock)
    _place(reference, 1)
    before = {name: p.detach().cpu().clone() for name, p in actor.model.named_parameters()}

    actor.compute_old_logprobs(StageCall(1))
    reference.compute_ref_logprobs(StageCall(1))
    dock.batch["advantage"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
    stats = actor.update(StageCall(1))

    assert dock.batch["old_logprobs"].device == dock.batch["ref_logprobs"].device == torch.device("cpu")
    assert torch.isfinite(torch.tensor([stats.metrics["loss"], stats.metrics["kl"], stats.metrics["grad_norm"]])).all()
    _assert_stepped_on(actor.model, "npu:0", before)
    assert actor.generation.engine.devices == {torch.device("npu:0")}  # the engine got the device's weights
    assert npu_twin.memory_allocated("npu:0") > 0 and npu_twin.memory_allocated("npu:1") > 0


def test_ppo_iteration_on_the_twin(npu_twin, twin_model_dir):
    cfg = _cfg(twin_model_dir, "ppo")
    dock = ColumnDock(rollout_batch(), states={})  # the workers ask for their recipe's columns
    actor = _actor(cfg, twin_model_dir, dock)
    reference = ReferenceWorker(cfg, recipe=job_recipe(cfg), rank=0, reference_dir=str(twin_model_dir), banks=dock)
    _place(reference, 1)
    critic = CriticWorker(cfg, recipe=job_recipe(cfg), policy_dir=str(twin_model_dir), banks=dock)
    _place(critic, 2)
    critic.backend.optimizer = critic._make_optimizer(critic.model.parameters())
    actor_before = {name: p.detach().cpu().clone() for name, p in actor.model.named_parameters()}
    critic_before = {name: p.detach().cpu().clone() for name, p in critic.model.named_parameters()}

    actor.compute_old_logprobs(StageCall(1))
    reference.compute_ref_logprobs(StageCall(1))
    critic.compute_values(StageCall(1))
    mask = dock.batch["response_mask"].float()
    dock.batch["advantage"] = torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]) * mask  # (B, SL) per token
    dock.batch["returns"] = dock.batch["values"] + dock.batch["advantage"]
    dock.batch["value_mask"] = dock.batch["response_mask"].clone()  # GAE by token: every model token trains
    actor_stats = actor.update(StageCall(1))
    critic_stats = critic.update(StageCall(1))

    assert torch.isfinite(torch.tensor([actor_stats.metrics["loss"], critic_stats.metrics["value_loss"]])).all()
    _assert_stepped_on(actor.model, "npu:0", actor_before)
    _assert_stepped_on(critic.model, "npu:2", critic_before)
    assert npu_twin.memory_allocated("npu:2") > 0
