"""LoRA on the actor's policy (`training.lora`): peft adapters on chosen Linear layers, the merged
weights the generation engine loads, and the base model as the reference policy.

The adapters are never merged into the trained model: `merged_weights` computes W + B A * alpha/r
per adapted layer for the sync only, so the base weights stay frozen and the optimizer keeps
stepping the same A and B. The reference policy is the base model, i.e. the same module with its
adapters switched off (`adapters_off`), so no second copy of the weights is loaded anywhere.

peft is imported where adapters are added (`add_lora`), so a job without LoRA never loads it (about
2 s of CPU per process beyond transformers): until then no model can have adapters, which is how
`has_adapters` answers without importing it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

from rldock.config.training import LoraSpec

if TYPE_CHECKING:
    from peft import PeftModel

ADAPTER = "default"  # peft's name for a model's only adapter


def add_lora(model: torch.nn.Module, spec: LoraSpec, *, adapter_dir: str | Path | None = None) -> PeftModel:
    """`model` with fresh adapters on `spec.target_modules` (B = 0, so the policy starts equal to the
    base model), or with the trained ones saved in `adapter_dir`; only adapter parameters train.
    Raises ValueError naming training.lora.target_modules when none of them is in the model."""
    from peft import LoraConfig, PeftModel, get_peft_model

    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    if not names & set(spec.target_modules):
        raise ValueError(
            f"training.lora.target_modules {spec.target_modules} names no Linear module of the model "
            f"(it has {sorted(names)})"
        )
    if adapter_dir is not None:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    # peft annotates lora_alpha as int; it scales by alpha / r as a float, so a float alpha is kept as given
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,  # type: ignore[arg-type]
        target_modules=list(spec.target_modules),
        lora_dropout=spec.dropout,
        bias="none",
    )
    return get_peft_model(model, config)


def has_adapters(model: torch.nn.Module) -> TypeGuard[PeftModel]:
    """Whether `model` is a PeftModel (training.lora), without importing peft (module docstring)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def merged_weights(model: PeftModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight of the base model with the adapters merged in, as a plain
    model's `state_dict()` would name them; computed on the fly, the model is left unchanged."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    # LoraLayer is the mixin; get_delta_weight is on the concrete layer (lora.Linear)
    adapted: dict[str, Any] = {name: module for name, module in base.named_modules() if isinstance(module, LoraLayer)}
    with torch.no_grad():
        for name, tensor in base.state_dict().items():
            if ".lora_" in name:
                continue
            owner, _, leaf = name.rpartition(".")
            owner = owner.removesuffix(".base_layer")
            if leaf == "weight" and owner in adapted:
                tensor = tensor + adapted[owner].get_delta_weight(ADAPTER)  # W + B A * alpha / r
            yield f"{owner}.{leaf}", tensor


@contextlib.contextmanager
def adapters_off(model: PeftModel) -> Iterator[None]:
    """The base model (the reference policy) inside the block: the adapters are skipped."""
    with model.disable_adapter():
        yield
