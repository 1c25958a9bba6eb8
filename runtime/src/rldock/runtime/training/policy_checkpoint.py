"""The actor's part of a checkpoint (rldock.runtime.checkpoint's layout): `policy/` in Hugging Face
format, which the rollout engine and a resume load (under LoRA the adapters merged in, and the
trained adapters apart in `adapter/`, peft format, for the resume to load onto the base), the
tokenizer beside it, and the optimizer state where the training backend keeps it (`optimizer.pt`,
or TP shards beside it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rldock.runtime.checkpoint import ADAPTER_DIR, OPTIMIZER_FILE, POLICY_DIR
from rldock.runtime.models.lora import has_adapters
from rldock.runtime.training.backend import TrainingBackend, WeightIter


def save_policy(
    staging: Path,
    *,
    backend: TrainingBackend,
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    rank: int,
    generation_weights: Callable[[], WeightIter],
) -> None:
    """Rank 0 writes the policy and the tokenizer; every rank writes the optimizer state as the
    backend keeps it. Collective under FSDP and TP (gathers), with the training state swapped in for
    the save and out again after. `generation_weights`: the policy as the engine loads it (LoRA: the
    adapters merged in)."""
    with backend.resident():
        weights = backend.full_weights()
        backend.save_optimizer(staging / OPTIMIZER_FILE)
        if rank != 0:
            return
        if has_adapters(model):  # training.lora: the merged policy, the adapters to resume
            base = cast(PreTrainedModel, model.get_base_model())  # peft types it nn.Module
            base.save_pretrained(staging / POLICY_DIR, state_dict=dict(generation_weights()))
            model.save_pretrained(str(staging / ADAPTER_DIR))
        else:  # the whole model, gathered from the shards where it is sharded
            cast(PreTrainedModel, model).save_pretrained(staging / POLICY_DIR, state_dict=weights)
        tokenizer.save_pretrained(staging / POLICY_DIR)
