"""Fixtures for the runtime's unit tests."""

from __future__ import annotations

import time
from typing import Callable

import pytest


def _kill_and_wait_until_dead(handle, timeout_s: float = 60.0) -> None:
    """`ray.kill` only asks for the kill: until Ray has acted on it, calls still reach the actor.
    Wait for the state a test needs, a call that fails because the actor died, not for a guess."""
    import ray
    from ray.exceptions import RayActorError

    ray.kill(handle)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.__ray_ready__.remote(), timeout=timeout_s)
        except RayActorError:
            return
        time.sleep(0.01)
    raise TimeoutError(f"actor {handle} still answers {timeout_s} s after ray.kill")


@pytest.fixture
def kill_actor() -> Callable[..., None]:
    """Kill a Ray actor and return once it is dead."""
    return _kill_and_wait_until_dead


def build_tiny_reward_model(path, *, texts, num_labels: int = 1, constant: float | None = None, seed: int = 0):
    """Save a tiny Qwen2ForSequenceClassification (no pad id in its config, as many are) and a
    char tokenizer trained on `texts` at `path`. With `constant`, its weights are set so that it
    scores every text exactly that: every token embeds to the same vector, the layers add nothing
    (zero output projections), so the final hidden state is that vector's RMS norm, all ones, and
    the score head's weights are constant / hidden_size."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rldock.runtime.models.tiny import train_char_tokenizer

    tokenizer = train_char_tokenizer(texts)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         num_labels=num_labels, rms_norm_eps=1e-12)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    if constant is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight.fill_(1.0)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.score.weight.fill_(constant / config.hidden_size)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def tiny_reward_model():
    """`build_tiny_reward_model(path, *, texts, ...)`: a tiny reward model folder."""
    return build_tiny_reward_model
