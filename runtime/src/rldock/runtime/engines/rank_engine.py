"""One actor rank's generation engine: its start-up and the policy's weights handed to it.

A generation replica is `rollout.tensor_parallel_size` consecutive actor ranks; its first rank
holds the replica's one vLLM engine (of that TP, over the replica's devices) and generates the
replica's share of the prompts, its other ranks hold none and lend their devices to it. The actor
worker owns one `RankEngine` and hands it the model it trains: the engine starts from the policy's
files and, after each update, loads the weights the training backend exports (`push`); a rank
without an engine still draws them (under FSDP each tensor is gathered from every rank as drawn).
With a rollout pool (rollout.pool) actor rank 0 also keeps a host copy of what it pushes, which the
driver hands to the pool's engines (`take_published`; driver/rollout_pool.py).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rldock.config import JobConfig
from rldock.runtime.device import DeviceInfo
from rldock.runtime.engines.generation_memory import engine_kv_cache_bytes
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.models.lora import has_adapters, merged_weights
from rldock.runtime.resharding.parallel_layout import ParallelLayout
from rldock.runtime.startup import collections_paused

# (HF name, tensor) pairs as the engine loads them
Weights = Iterable[tuple[str, torch.Tensor]]
# The training backend's hook (TrainingBackend.attach_engine): where exported weights go, and what
# the engine reloads after a level-2 sleep.
Attach = Callable[[VllmRolloutEngine, Callable[[], Weights]], None]


def engine_batch_size(cfg: JobConfig, *, num_actor_ranks: int, pool_engines: int | None = None) -> int:
    """Samples one engine asks the dock for at a time. Without a rollout pool, its generation replica's share
    of the iteration (one request per engine). With one, the iteration over every engine, the actor ranks' and
    the pool's (`pool_engines` up now; None: rollout.pool.replicas), in whole groups (at least one): an engine
    that is free asks again while groups are left."""
    tp = cfg.rollout.tensor_parallel_size
    if cfg.rollout.pool is None:
        return cfg.num_samples_per_iteration // num_actor_ranks * tp
    replicas = num_actor_ranks // tp if cfg.rollout.pool.actors_generate else 0
    engines = replicas + (cfg.rollout.pool.replicas if pool_engines is None else pool_engines)
    group = cfg.rows_per_group
    return max(cfg.num_samples_per_iteration // max(engines, 1) // group, 1) * group


class RankEngine:
    """The engine of one actor rank, or None on a replica's other ranks and under DPO (`needed`
    False: it trains on given responses)."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        model: nn.Module,
        policy_dir: str,
        device: DeviceInfo,
        rank: int,
        world_size: int,
        needed: bool,
    ):
        self.cfg, self.model, self.policy_dir, self.device, self.rank = cfg, model, policy_dir, device, rank
        self.layout = ParallelLayout.over(
            world_size, tp_size=cfg.rollout.tensor_parallel_size, field="rollout.tensor_parallel_size"
        )
        self.holds_engine = needed and self.layout.tp_rank(rank) == 0
        # Rank 0 publishes each version to the rollout pool's engines (a generation TP of 1 there: rollout_pool.py).
        self.publishes = needed and rank == 0 and cfg.rollout.pool is not None
        self.published: PublishedWeights | None = None
        self.engine: VllmRolloutEngine | None = None  # started by `start` on a replica's first rank
        # The samples the replica's engine asks the dock for at a time.
        self.replica_samples = engine_batch_size(cfg, num_actor_ranks=world_size)

    def start(self, engine_env: Mapping[str, str] | None, *, attach: Attach) -> None:
        """Start the engine on a replica's first rank, after the trainers' process group exists (an
        in-process vLLM engine adopts the default group if there is one, and otherwise creates a world
        of one that no later group could replace). `engine_env`: at generation TP > 1 on an
        accelerator, the replica's visible devices (rldock.runtime.engines.replica_devices), set while
        the engine spawns its TP workers."""
        if not self.holds_engine:
            return
        algo = self.cfg.algorithm
        max_model_len = algo.max_prompt_length + algo.max_response_length
        # vLLM's import and the engine's build, without cyclic collections (rldock.runtime.startup)
        with _environment(engine_env or {}), collections_paused():
            self.engine = VllmRolloutEngine(
                self.policy_dir,
                rollout=self.cfg.rollout,
                dtype=self.cfg.model.dtype,
                seed=self.cfg.seed,
                max_model_len=max_model_len,
                device=self.device,
                kv_cache_bytes=engine_kv_cache_bytes(
                    self.cfg,
                    self.model,
                    device=self.device,
                    generation_tp=self.layout.tp_size,
                    max_model_len=max_model_len,
                ),
            )
        attach(self.engine, self.weights)
        if has_adapters(self.model):  # the engine started from the base; the policy has adapters
            self.push(self.weights())  # (kept for a rollout pool's engines, which started from the base too)

    def held(self) -> VllmRolloutEngine:
        """This rank's engine; only the first rank of a generation replica holds one."""
        if self.engine is None:
            raise RuntimeError(
                f"actor rank {self.rank} holds no engine (rollout.tensor_parallel_size "
                f"{self.layout.tp_size}): generate and evaluate on ranks {self.layout.leaders()}"
            )
        return self.engine

    @contextmanager
    def lent(self) -> Iterator[VllmRolloutEngine]:
        """This rank's engine, awake, for one call; asleep after it (the device is the trainer's
        until the next generation)."""
        engine = self.held()
        yield engine
        engine.sleep()

    def weights(self) -> Weights:
        """(HF name, tensor) pairs of the policy as the engine loads them: the adapters merged in on
        the fly under LoRA (the trained adapters stay as they are)."""
        if has_adapters(self.model):  # training.lora
            return merged_weights(self.model)
        return self.model.state_dict().items()

    def push(self, named_tensors: Weights) -> None:
        """The new weights into this rank's engine; a rank without one (a generation TP peer) has
        nothing to load, its replica's first rank pushes the same full weights. It still runs the
        iterator to the end: under FSDP each tensor is gathered from every rank as it is drawn.
        A publishing rank keeps a host copy of each tensor as it goes by (`take_published`)."""
        if self.publishes:
            named_tensors = self._kept(named_tensors)
        if self.engine is not None:
            self.engine.update_weights(named_tensors)
            return
        for _ in named_tensors:
            pass

    def _kept(self, named_tensors: Weights) -> Iterator[tuple[str, torch.Tensor]]:
        """`named_tensors` as they are, each copied to the host on the way into `published`, in the dtype the
        engines generate in (the pool's are this rank's kind: a float32 master publishes half the bytes to
        bfloat16 engines, and an engine's own cast of them would round the same way)."""
        kept, copy_s = {}, 0.0
        dtype = None if self.engine is None else getattr(torch, self.engine.dtype)
        for name, tensor in named_tensors:
            started = time.perf_counter()
            kept[name] = HostTensor.of(tensor, dtype=dtype)
            copy_s += time.perf_counter() - started
            yield name, tensor
        self.published = PublishedWeights(version=-1, weights=kept, copy_s=copy_s)

    def take_published(self, version: int) -> PublishedWeights | None:
        """What the last push kept, as policy `version`, for the pool's engines (None on a rank that does not
        publish); the copy is the caller's from then on."""
        published, self.published = self.published, None
        if published is None:
            return None
        return PublishedWeights(version=version, weights=published.weights, copy_s=published.copy_s)


@dataclass(frozen=True)
class HostTensor:
    """A tensor on the host as its bytes in a numpy array, with its dtype and shape: what Ray's object store
    keeps out of band, so that a reader on the same node maps it from shared memory instead of unpickling a
    copy (a torch tensor goes through pickle), and reads it without copying before its own load."""

    bits: np.ndarray  # (bytes,) uint8
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def of(cls, tensor: torch.Tensor, *, dtype: torch.dtype | None = None) -> HostTensor:
        """A host copy of `tensor` (any device, any dtype: numpy has no bfloat16, so its bytes are kept), cast
        to `dtype` when given."""
        host = tensor.detach().to("cpu", dtype=dtype, copy=True).contiguous()
        bits = host.reshape(-1).view(torch.uint8).numpy()
        return cls(bits=bits, dtype=str(host.dtype).removeprefix("torch."), shape=tuple(host.shape))

    def tensor(self) -> torch.Tensor:
        """The tensor, a view of the bytes (read-only where the object store maps them: the load copies it)."""
        with warnings.catch_warnings():  # torch warns that the mapped array is not writable; nothing writes it
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(self.bits).view(getattr(torch, self.dtype)).reshape(self.shape)


@dataclass(frozen=True)
class PublishedWeights:
    """A policy version as the rollout pool's engines load it: the full weights by Hugging Face name, on the host,
    and the seconds actor rank 0 spent copying them there."""

    version: int
    weights: dict[str, HostTensor]
    copy_s: float

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs as an engine's update takes them."""
        return ((name, host.tensor()) for name, host in self.weights.items())


@contextmanager
def _environment(overrides: Mapping[str, str]) -> Iterator[None]:
    """`overrides` in os.environ (the engine's TP workers inherit them when spawned), put back after
    so that nothing this process starts later sees the replica's other devices."""
    saved = {name: os.environ.get(name) for name in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
