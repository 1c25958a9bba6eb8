"""Causal LMs and tokenizers in Hugging Face format: loading, text<->tensor helpers, builders.

`ensure_model(spec, texts=..., seed=...)` is the entry point for a job: it builds the model named
by `model.builder` when `model.path` holds no model yet, and otherwise leaves the path alone.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

from rldock.config.job import ModelSpec
from rldock.runtime.models.loading import (
    TokenBatch,
    decode_responses,
    encode_answers,
    encode_prompts,
    load_causal_lm,
    load_tokenizer,
    max_token_length,
    pad_prompts,
)
from rldock.runtime.registry import Registry

logger = logging.getLogger(__name__)

ModelBuilder = Callable[..., Path]  # (path, *, texts, seed) -> path

MODEL_BUILDERS: Registry[ModelBuilder] = Registry("model builder", field="model.builder")


def _tiny(path: str | Path, **kwargs) -> Path:
    """models.tiny.build_tiny_model, imported when a model is built: transformers' config classes
    cost ~2 s of CPU that a process which only tokenises (the reward worker) never needs."""
    from rldock.runtime.models.tiny import build_tiny_model

    return build_tiny_model(path, **kwargs)


MODEL_BUILDERS.register("tiny-qwen2")(_tiny)
MODEL_BUILDERS.register("tiny-llama")(functools.partial(_tiny, architecture="llama"))
MODEL_BUILDERS.register("tiny-qwen3")(functools.partial(_tiny, architecture="qwen3"))
MODEL_BUILDERS.register("tiny-qwen3-moe")(functools.partial(_tiny, architecture="qwen3_moe"))
MODEL_BUILDERS.register("tiny-deepseek-v3")(functools.partial(_tiny, architecture="deepseek_v3"))


def ensure_model(spec: ModelSpec, *, texts: Iterable[str], seed: int) -> bool:
    """Build the model at `spec.path` with `spec.builder` if no model is there; True if built."""
    path = Path(spec.path)
    if (path / "config.json").exists():
        return False
    if spec.builder is None:
        raise ValueError(
            f"model.path {spec.path} holds no model (no config.json); point it at a Hugging Face "
            f"format model or set model.builder to one of {list(MODEL_BUILDERS)}"
        )
    MODEL_BUILDERS.get(spec.builder)(path, texts=texts, seed=seed)
    return True


__all__ = [
    "MODEL_BUILDERS",
    "TokenBatch",
    "decode_responses",
    "encode_answers",
    "encode_prompts",
    "ensure_model",
    "load_causal_lm",
    "load_tokenizer",
    "max_token_length",
    "pad_prompts",
]
