"""The generation engine's device memory: how big its KV cache may be, and its sleep/wake cycle.

An actor rank's device holds the trainer and the engine in turn. While it generates, the engine
needs its weights and KV cache; while it trains, the trainer needs params, grads and optimizer
state. So around every generation phase the engine wakes (weights, then KV cache) and sleeps
after it (`SleepCycle`), and the KV cache is sized for the generation phase (`kv_cache_budget`):
the engine's share of the device less its own weights and whatever of the training state stays on
the device while it generates (all of it with `training.resharding: naive`, none with
`allgather_swap`, which swaps it to the host: the memory the swap frees goes to the KV cache).

On CPU vLLM refuses sleep mode (`enable_sleep_mode` raises), so the cycle runs the same sequence
with every sleep and wake a no-op: the engine keeps its weights and a fixed KV cache of
`rollout.cpu_kv_cache_gib` (else planning/cpu_kv_cache.py's default) in host memory, and nothing is freed
between phases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from rldock.config.rollout import generation_dtype

if TYPE_CHECKING:
    from rldock.config import JobConfig
    from rldock.runtime.device import DeviceInfo

logger = logging.getLogger(__name__)


class GenerationMemoryError(ValueError):
    """The device cannot hold the engine's weights and a useful KV cache."""


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes: a key and a value per layer and KV head."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def kv_cache_budget(
    *,
    device_bytes: int,
    utilization: float,
    engine_weight_bytes: int,
    resident_training_bytes: int,
    min_tokens: int,
    bytes_per_token: int,
) -> int:
    """Bytes the engine's KV cache may take on one device while generating:
    utilization * device - engine weights - training state still on the device.

    Raises GenerationMemoryError (naming the fields to change) when that leaves less than
    `min_tokens` tokens of cache (one full-length sequence: max_prompt_length + max_response_length)."""
    share = int(device_bytes * utilization)
    budget = share - engine_weight_bytes - resident_training_bytes
    if budget < min_tokens * bytes_per_token:
        raise GenerationMemoryError(
            f"rollout.gpu_memory_utilization {utilization} gives the engine {share / 2**30:.2f} GiB of the "
            f"device's {device_bytes / 2**30:.2f} GiB; its weights take {engine_weight_bytes / 2**30:.2f} GiB and "
            f"the training state left on the device {resident_training_bytes / 2**30:.2f} GiB, leaving "
            f"{max(budget, 0) / 2**30:.3f} GiB for the KV cache, less than one sequence of {min_tokens} tokens "
            f"({min_tokens * bytes_per_token / 2**30:.3f} GiB). Raise rollout.gpu_memory_utilization, use "
            "training.resharding allgather_swap (swaps the training state out while generating) or shorten "
            "algorithm.max_response_length"
        )
    return budget


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Sleeper(Protocol):
    """The engine calls the cycle makes (vLLM's `LLM.sleep` and `LLM.wake_up`)."""

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self, tags: list[str] | None = None) -> object: ...


@dataclass
class SleepCycle:
    """The engine's memory states around generation: `asleep` (weights offloaded at level 1,
    discarded at level 2; KV cache freed), `weights` (weights back, KV cache still freed; new
    weights load in this state) and `awake` (generating).

    `enabled` False (CPU) runs the same transitions without calling the engine. `reload` puts the
    current weights back when level 2 discarded them and no update brought new ones since.
    """

    engine: Sleeper
    level: int
    enabled: bool
    reload: Callable[[], None] | None = None
    state: str = "awake"  # vLLM starts with weights and KV cache allocated
    weights_stale: bool = False  # level 2 discarded them and nothing was loaded since
    log: list[str] = field(default_factory=list)  # the engine calls made, in order

    def __post_init__(self) -> None:
        if self.level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {self.level}")

    def before_weight_update(self) -> None:
        """Weights back on the device (the KV cache stays freed) so new ones can load in place."""
        if self.state == "asleep":
            self._call("wake_up", tags=["weights"])
            self.state = "weights"

    def after_weight_update(self) -> None:
        self.weights_stale = False

    def before_generation(self) -> None:
        """Weights (reloaded if level 2 dropped them), then the KV cache."""
        if self.state == "awake":
            return
        self.before_weight_update()
        if self.weights_stale:
            if self.reload is None:
                raise RuntimeError("sleep level 2 discarded the engine's weights and no reload is set")
            self.reload()  # update_weights: after_weight_update clears the flag
        self._call("wake_up", tags=["kv_cache"])
        self.state = "awake"

    def after_generation(self) -> None:
        """Free the engine's device memory for the trainer."""
        if self.state == "asleep":
            return
        self._call("sleep", level=self.level)
        self.state = "asleep"
        self.weights_stale = self.level == 2

    def _call(self, method: str, **kwargs) -> None:
        self.log.append(f"{method}({', '.join(f'{k}={v}' for k, v in kwargs.items())})")
        if self.enabled:
            getattr(self.engine, method)(**kwargs)


def engine_kv_cache_bytes(
    cfg: JobConfig, model: nn.Module, *, device: DeviceInfo, generation_tp: int, max_model_len: int
) -> int | None:
    """An actor rank's engine KV cache on an accelerator: its share of the device less its weights
    and the training state left there while generating (none when allgather_swap swaps it out).
    None for a CPU engine (the npu twin's too), sized by planning/cpu_kv_cache.py."""
    if device.engine_kind == "cpu":
        return None
    params = list(model.parameters())
    weight_bytes = tensor_bytes(params)
    # The engine holds the weights (and its KV cache) in its own dtype, rollout.dtype when set.
    engine_element_size = getattr(
        torch, generation_dtype(model_dtype=cfg.model.dtype, rollout_dtype=cfg.rollout.dtype, on_cpu=False)
    ).itemsize
    # per device: vLLM splits them over the replica's generation TP
    engine_weight_bytes = weight_bytes // params[0].element_size() * engine_element_size // generation_tp
    trainable_bytes = tensor_bytes(p for p in params if p.requires_grad)
    # grads plus AdamW's two moments, one of each per trainable parameter
    resident = 0 if cfg.training.resharding == "allgather_swap" else weight_bytes + 3 * trainable_bytes
    config: Any = model.config  # the architecture's Hugging Face config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device_type = torch.device(device.torch_device).type
    budget = kv_cache_budget(
        device_bytes=torch.get_device_module(device_type).mem_get_info()[1],
        utilization=cfg.rollout.gpu_memory_utilization,
        engine_weight_bytes=engine_weight_bytes,
        resident_training_bytes=resident,
        min_tokens=max_model_len,
        bytes_per_token=kv_bytes_per_token(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads // generation_tp,
            head_dim=head_dim,
            dtype_bytes=engine_element_size,
        ),
    )
    logger.info(
        "KV cache %.2f GiB (engine weights %.2f GiB, training state resident while generating %.2f GiB)",
        budget / 2**30,
        engine_weight_bytes / 2**30,
        resident / 2**30,
    )
    return budget
