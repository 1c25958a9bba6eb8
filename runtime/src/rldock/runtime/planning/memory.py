"""Per-device bytes of one actor rank in the training (update) and generation phases.

Every figure is arithmetic on the config and the model shape (bytes, no torch):

- parameters: P x param bytes (model.dtype; float32 masters under mixed precision), divided by the
  data-parallel size under FSDP and the TP size for the decoder layers' weights under TP.
- gradients: trainable parameters (less the vocabulary matrices with training.freeze_embeddings)
  x param bytes, sharded the same way.
- optimizer state: AdamW's two moments, 2 x trainable x param bytes, sharded the same way.
- FSDP gathered weights: while a layer computes, FSDP holds its full weights in the compute dtype,
  and the next layer's are prefetched: 2 x layer params, plus the root's (embeddings, LM head),
  which stay gathered through the forward/backward.
- activations (an estimate) for one micro-batch of b = training.micro_batch_size sequences of
  s = max_prompt_length + max_response_length tokens, e bytes per compute element: per layer the
  tensors autograd keeps, b*s*(4h + (n_q + 2 n_kv) d + n_q d + 4 I) x e (two norm inputs and
  outputs, q/k/v, the attention output, the MLP's gate, up, activation and product; attention
  scores not kept, as with fused/flash attention), times L layers; with
  training.gradient_checkpointing only each layer's input b*s*h x e is kept, plus one layer's
  full set while it is recomputed. The logits add b*s*V x 4 x 2 (float32 logits and their
  log-softmax).
- generation weights: the model in model.dtype over rollout.tensor_parallel_size devices (one vLLM
  engine per generation replica, its weights split by vLLM's TP; the whole model at TP 1).
- KV cache: on an accelerator vLLM takes rollout.gpu_memory_utilization of the device and keeps
  what its weights leave as cache; on CPU, rollout.cpu_kv_cache_gib.

Phases: in the update the engine keeps its weights and cache (no sleep mode in this release), so the
update phase holds the engine plus the training state, gathered weights and activations. During
generation the training state stays on the device unless training.resharding is allgather_swap
(swapped to the host) or training.fsdp_cpu_offload (it lives on the host).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rldock.config import JobConfig
from rldock.runtime.planning.shapes import ModelShape

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMPUTE_BYTES = {"bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class PhaseBytes:
    """Device bytes by category in one phase; `host` is training state held in host memory."""

    params: int = 0
    grads: int = 0
    optimizer_state: int = 0
    fsdp_gathered: int = 0
    activations: int = 0
    generation_weights: int = 0
    kv_cache: int = 0
    host: int = 0

    @property
    def device_total(self) -> int:
        return sum(value for key, value in asdict(self).items() if key != "host")

    @property
    def training_state(self) -> int:
        return self.params + self.grads + self.optimizer_state


@dataclass(frozen=True)
class MemoryPlan:
    model: str
    num_params: int
    strategy: str
    data_parallel_size: int
    tensor_parallel_size: int
    update: PhaseBytes
    generation: PhaseBytes
    device_memory: int | None
    kv_cache_tokens: int

    @property
    def peak(self) -> int:
        return max(self.update.device_total, self.generation.device_total)


def training_state_bytes(cfg: JobConfig, shape: ModelShape) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes one actor rank holds."""
    training = cfg.training
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    tp = training.tensor_parallel_size
    shard = training.data_parallel_size if training.strategy == "fsdp" else 1
    vocab = shape.embedding_params
    layers = shape.num_layers * shape.layer_params
    params = vocab + layers // tp + shape.hidden_size  # TP splits the decoder layers' weights only
    trainable = params - (vocab if training.freeze_embeddings else 0)
    return (-(-params * param_bytes // shard), -(-trainable * param_bytes // shard),
            -(-2 * trainable * param_bytes // shard))


def activation_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """The update's activations for one micro-batch (see the module docstring for the formula)."""
    algo, training = cfg.algorithm, cfg.training
    tokens = training.micro_batch_size * (algo.max_prompt_length + algo.max_response_length)
    element = COMPUTE_BYTES.get(training.mixed_precision, DTYPE_BYTES[cfg.model.dtype])
    h, d, tp = shape.hidden_size, shape.head_dim, training.tensor_parallel_size
    per_layer = tokens * (4 * h + ((shape.num_heads + 2 * shape.num_kv_heads) * d + shape.num_heads * d
                                   + 4 * shape.intermediate_size) // tp) * element
    if training.gradient_checkpointing:
        layers = shape.num_layers * tokens * h * element + per_layer
    else:
        layers = shape.num_layers * per_layer
    logits = tokens * shape.vocab_size * 4 * 2
    return layers + logits


def _engine_bytes(cfg: JobConfig, shape: ModelShape, device_memory: int | None) -> tuple[int, int]:
    """(generation weights, KV cache) per device of the replica's vLLM engine (split over its TP)."""
    weights = shape.num_params * DTYPE_BYTES[cfg.model.dtype] // cfg.rollout.tensor_parallel_size
    if cfg.resources.device == "cpu" or device_memory is None:
        return weights, int(cfg.rollout.cpu_kv_cache_gib * GIB)
    return weights, max(0, int(cfg.rollout.gpu_memory_utilization * device_memory) - weights)


def plan_memory(cfg: JobConfig, shape: ModelShape, *, device_memory: int | None = None) -> MemoryPlan:
    """The per-device bytes of `cfg` with `shape`; `device_memory` (bytes) defaults to the config's."""
    if device_memory is None and cfg.resources.device_memory_gib is not None:
        device_memory = int(cfg.resources.device_memory_gib * GIB)
    training = cfg.training
    params, grads, optimizer = training_state_bytes(cfg, shape)
    weights, kv_cache = _engine_bytes(cfg, shape, device_memory)
    gathered = 0
    if training.strategy == "fsdp":
        element = COMPUTE_BYTES.get(training.mixed_precision, DTYPE_BYTES[cfg.model.dtype])
        gathered = (2 * shape.layer_params + shape.embedding_params) * element
    offloaded = training.strategy == "fsdp" and training.fsdp_cpu_offload
    state = (0, 0, 0) if offloaded else (params, grads, optimizer)
    host = params + grads + optimizer if offloaded else 0
    update = PhaseBytes(*state, fsdp_gathered=gathered, activations=activation_bytes(cfg, shape),
                        generation_weights=weights, kv_cache=kv_cache, host=host)
    swapped = training.resharding == "allgather_swap"
    generation = PhaseBytes(*((0, 0, 0) if swapped else state), generation_weights=weights, kv_cache=kv_cache,
                            host=host + (params + grads + optimizer if swapped and not offloaded else 0))
    return MemoryPlan(model=shape.name, num_params=shape.num_params, strategy=training.strategy,
                      data_parallel_size=training.data_parallel_size,
                      tensor_parallel_size=training.tensor_parallel_size, update=update, generation=generation,
                      device_memory=device_memory,
                      kv_cache_tokens=kv_cache * cfg.rollout.tensor_parallel_size
                      // shape.kv_bytes_per_token(DTYPE_BYTES[cfg.model.dtype]))  # a device holds 1/TP of the KV heads
