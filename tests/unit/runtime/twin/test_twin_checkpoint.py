"""Checkpoint save and resume from a model on the npu twin: the actor's own save (HF weights and
optimizer, and the RNG state it returns) and its restore, with tensors coming back on the
device they are resumed on."""

from __future__ import annotations

import torch

from rldock.config.job import JobConfig
from rldock.runtime.device import detect_device
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.models.loading import load_causal_lm
from rldock.runtime.workers.actor import ActorWorker


def _actor(model_dir, index: int) -> ActorWorker:
    cfg = JobConfig(
        iterations=1,
        model={"path": str(model_dir)},
        resources={"device": "npu"},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 4,
            "max_response_length": 3,
            "learning_rate": 1e-3,
        },
    )
    actor = ActorWorker(cfg, recipe=job_recipe(cfg), rank=0, world_size=1, policy_dir=str(model_dir), banks=None)
    actor.device = detect_device("npu", index=index)
    actor.model.to(actor.device.torch_device)
    actor.backend.optimizer = actor._make_optimizer(actor.model.parameters())
    return actor


def test_actor_checkpoint_from_the_device_resumes_on_the_device(npu_twin, twin_model_dir, tmp_path):
    actor = _actor(twin_model_dir, index=4)
    tokens = torch.tensor([[5, 6, 7, 8]], device="npu:4")
    actor.model(input_ids=tokens, labels=tokens).loss.backward()
    actor.backend.optimizer.step()

    rng = actor.save(str(tmp_path))

    saved = load_causal_lm(str(tmp_path / "policy"), dtype="float32", device="cpu")
    for (name, ours), theirs in zip(actor.model.state_dict().items(), saved.state_dict().values()):
        assert torch.equal(ours.cpu(), theirs), name
    resumed = _actor(tmp_path / "policy", index=5)
    resumed.restore(str(tmp_path), rng)
    assert torch.equal(torch.get_rng_state(), rng)
    restored = resumed.backend.optimizer.state_dict()["state"]
    original = actor.backend.optimizer.state_dict()["state"]
    assert restored.keys() == original.keys()
    for key, per_param in restored.items():
        assert per_param["exp_avg"].device == torch.device("npu:5")  # map_location: the resuming worker's device
        assert torch.equal(per_param["exp_avg"].cpu(), original[key]["exp_avg"].cpu())
