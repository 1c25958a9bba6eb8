"""The bytes a checkpoint writes (planning/checkpoint_size.py) against the files the product's own save writes
for a tiny model: the policy (training/policy_checkpoint.py's save_policy through a lone rank's backend) and,
for PPO, the critic (CriticWorker.save), each after one AdamW step so that the optimizer holds its moments;
the driver's estimate of a save from them and the measured write rate."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import torch

from rldock.config.job import JobConfig
from rldock.runtime.checkpoint import CRITIC_FILE, CRITIC_OPTIMIZER_FILE, OPTIMIZER_FILE, POLICY_DIR, measure_write_rate
from rldock.runtime.device import detect_device
from rldock.runtime.driver.inputs import estimate_checkpoint_save
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.models.loading import load_causal_lm, load_tokenizer
from rldock.runtime.models.tiny import build_tiny_model
from rldock.runtime.planning.checkpoint_size import SAVE_FIXED_S, SAVE_WORK_FACTOR, checkpoint_bytes, save_seconds
from rldock.runtime.planning.shapes import load_shape
from rldock.runtime.training.group import TrainingGroup
from rldock.runtime.training.policy_checkpoint import save_policy
from rldock.runtime.workers.critic import CriticWorker

NUM_LAYERS = 2
# What a file holds besides its tensors' bytes, per tensor (its name, shape and offset: measured about 110 bytes in
# safetensors' JSON header, about 420 per moment in torch.save's archive) and per file. Smaller than any one
# matrix of the model: a tensor counted wrong or missed fails the comparison.
HEADER_PER_TENSOR, ARCHIVE_PER_TENSOR, FILE_SLACK = 256, 1024, 4096


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("policy"), texts=[string.ascii_lowercase + string.digits], seed=0, num_layers=NUM_LAYERS
    )


def _cfg(policy_dir: Path, *, algorithm: str, freeze_embeddings: bool) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": str(policy_dir)},
        resources={"device": "cpu"},
        training={"num_threads": 0, "freeze_embeddings": freeze_embeddings},
        algorithm={
            "name": algorithm,
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 3,
            "max_response_length": 3,
            "learning_rate": 1e-3,
        },
    )


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step on a loss that reaches every trained weight, so that each gets its two moments."""
    loss = sum((p.float() ** 2).sum() for p in model.parameters() if p.requires_grad)
    loss.backward()
    optimizer.step()


def _slack(tensors: int, per_tensor: int) -> int:
    return FILE_SLACK + per_tensor * tensors


@pytest.mark.parametrize("freeze_embeddings", [False, True])
def test_the_policy_and_its_optimizer_write_the_bytes_planned(policy_dir, tmp_path, freeze_embeddings):
    cfg = _cfg(policy_dir, algorithm="grpo", freeze_embeddings=freeze_embeddings)
    planned = checkpoint_bytes(cfg, load_shape(preset=None, model_path=str(policy_dir)))
    model = load_causal_lm(policy_dir, dtype="float32", device="cpu")
    if freeze_embeddings:  # as the actor freezes them (the tiny model's head is tied to the embedding)
        model.get_input_embeddings().requires_grad_(False)
    group = TrainingGroup(cfg, device=detect_device("cpu"), rank=0, world_size=1)
    backend = group.alone(model, lambda params: torch.optim.AdamW(params, lr=1e-3))
    _step(model, backend.optimizer)
    save_policy(
        tmp_path, backend=backend, model=model, tokenizer=load_tokenizer(policy_dir), rank=0, generation_weights=iter
    )
    tensors = len(model.state_dict())
    weights = sum(f.stat().st_size for f in (tmp_path / POLICY_DIR).glob("*.safetensors"))
    assert planned.critic == 0
    assert 0 <= weights - planned.policy <= _slack(tensors, HEADER_PER_TENSOR), (weights, planned.policy)
    optimizer = (tmp_path / OPTIMIZER_FILE).stat().st_size
    assert 0 <= optimizer - planned.optimizer <= _slack(tensors, ARCHIVE_PER_TENSOR), (optimizer, planned.optimizer)
    if freeze_embeddings:  # the embedding's moments are not written: less than twice the weights by them
        embedding = model.get_input_embeddings().weight.numel() * 4
        assert planned.optimizer == 2 * (planned.policy - embedding)


def test_the_critic_writes_the_bytes_planned(policy_dir, tmp_path):
    cfg = _cfg(policy_dir, algorithm="ppo", freeze_embeddings=False)
    planned = checkpoint_bytes(cfg, load_shape(preset=None, model_path=str(policy_dir)))
    critic = CriticWorker(cfg, recipe=job_recipe(cfg), policy_dir=str(policy_dir), banks=None)
    _step(critic.model, critic.backend.optimizer)
    critic.save(str(tmp_path))
    written = sum((tmp_path / name).stat().st_size for name in (CRITIC_FILE, CRITIC_OPTIMIZER_FILE))
    tensors = len(critic.model.state_dict())
    assert 0 <= written - planned.critic <= _slack(tensors, HEADER_PER_TENSOR + ARCHIVE_PER_TENSOR), (
        written,
        planned.critic,
    )


def test_the_driver_estimates_a_save_from_the_bytes_and_the_rate_it_measures(policy_dir, tmp_path):
    rate = measure_write_rate(tmp_path, size=4 * 1024**2)
    assert rate > 0 and not any((tmp_path / "checkpoints").iterdir())  # the probe file is gone
    cfg = _cfg(policy_dir, algorithm="ppo", freeze_embeddings=False)
    size = checkpoint_bytes(cfg, load_shape(preset=None, model_path=str(policy_dir)))
    assert save_seconds(size, write_rate=1024**2) == SAVE_FIXED_S + SAVE_WORK_FACTOR * size.total / 1024**2
    with pytest.raises(ValueError, match="write_rate must be positive"):
        save_seconds(size, write_rate=0)
    estimate = estimate_checkpoint_save(cfg, policy_dir, tmp_path)
    assert estimate is not None and 0 < estimate < 60
    assert estimate_checkpoint_save(cfg, tmp_path / "nowhere", tmp_path) is None  # no config.json: no figure


def test_rldock_plan_prints_the_checkpoint_and_its_save_at_the_write_rate_given(policy_dir, tmp_path, capsys):
    import json

    import yaml

    from rldock.runtime.cli import main

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(_cfg(policy_dir, algorithm="ppo", freeze_embeddings=False).model_dump()))
    assert main(["plan", str(config), "--json", "--write-rate", "1MiB"]) == 0
    printed = json.loads(capsys.readouterr().out)["checkpoint"]
    size = checkpoint_bytes(
        _cfg(policy_dir, algorithm="ppo", freeze_embeddings=False), load_shape(preset=None, model_path=str(policy_dir))
    )
    assert printed["total"] == size.total and printed["write_rate"] == 1024**2
    assert printed["save_s"] == save_seconds(size, write_rate=1024**2)
