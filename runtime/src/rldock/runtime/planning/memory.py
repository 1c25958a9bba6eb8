"""Per-device bytes of one actor rank in the training (update) and generation phases.

Every figure is arithmetic on the config and the model shape (bytes, no torch):

- parameters: P x param bytes (model.dtype; float32 masters under mixed precision), divided by the
  data-parallel size under FSDP and the TP size for the decoder layers' weights under TP.
- gradients: trainable parameters (less the vocabulary matrices with training.freeze_embeddings)
  x param bytes, sharded the same way.
- optimizer state: AdamW's two moments, 2 x trainable x param bytes, sharded the same way.
- FSDP's whole gradients (`fsdp_whole_gradient_bytes`, the update's `fsdp_whole_grads`, beside the shards):
  FSDP2 reduce-scatters a module's gradients only when the whole module's backward is done, so the
  root's (LM head) gradient stays whole, in the compute dtype, from the first step of the backward
  to its end, instead of its 1/N shard; and each layer's post-backward copies its whole gradient
  into a reduce-scatter input (reduce dtype: param bytes), which lives until the next layer's
  reduce-scatter. Measured at the update step's peak on gloo ranks at CP 2 and 4 (512 tokens,
  rldock_benchmarks.context_parallel): the LM head's whole gradient and the last-reduced layer's
  reduce-scatter input, beside the next layers' gathered weights (docs/scaling.md, section 9).
- FSDP gathered weights: while a layer computes, FSDP holds its full weights in the compute dtype,
  and the next layer's are prefetched: 2 x layer params, plus the root's (embeddings, LM head),
  which stay gathered through the forward/backward. Under expert parallelism a layer gathers only
  its EP rank's experts (1/expert_parallel_size of them); params, gradients and optimizer state
  per rank are the same 1/dp either way (experts over ep x dp/ep ranks, the rest over dp).
- activations (an estimate) for one micro-batch of b = training.micro_batch_size sequences of
  s = max_prompt_length + max_response_length tokens, e bytes per compute element: per layer the
  tensors autograd keeps, b*s*(4h + (n_q + 2 n_kv) d + n_q d + 4 I) x e (two norm inputs and
  outputs, q/k/v, the attention output, the MLP's gate, up, activation and product; attention
  scores not kept, as with fused/flash attention), times L layers; with
  training.gradient_checkpointing only each layer's input b*s*h x e is kept, plus one layer's
  full set while it is recomputed. An MoE layer's MLP terms count the k experts a token runs
  (4 k I_moe) and its dispatch 2 k h (the token's k copies and the k outputs). With
  training.micro_batch_tokens a pass computes at most that
  many tokens (b*s when smaller; one whole sequence s when larger). The LM head adds about three
  float32 (chunk, V) tensors, whatever b*s*V is: it runs on a chunk of scored positions at a time
  (engines/head_logprobs.py), the positions whose logits fit in LOGIT_CHUNK_BYTES (32 MiB).
- context parallelism (training.context_parallel_size): a rank computes and keeps 1/cp of a
  pass's tokens (Ulysses: its attention's tensors head-sharded over the whole sequence, as many
  elements, plus the kernel's output apart from the exchanged one the projection keeps: n_q d per
  token; ring: its own positions' q, k, v, plus the float32 merged output and log-sum-exps), and
  holds the pass's whole 4D mask unless the pass is one trimmed row (causal, no mask); FSDP shards
  the training state over DP x CP ranks; `all_to_all_bytes` is what a rank sends its CP group in one
  update step, by the mode's traffic (planning/context_parallel_bytes.py).
- generation weights: the model in the engine's dtype (rollout.dtype, else model.dtype) over
  rollout.tensor_parallel_size devices (one vLLM engine per generation replica, its weights split
  by vLLM's TP; the whole model at TP 1).
- KV cache: on an accelerator vLLM takes rollout.gpu_memory_utilization of the device and keeps
  what its weights leave as cache; on CPU, rollout.cpu_kv_cache_gib.

Phases: on an accelerator the engine sleeps through the update (rollout.sleep_level; vLLM sleep
mode): its KV cache is freed, and its weights go to host memory at level 1 or are discarded at level
2 (pushed again before the next generation). So the update's training step holds the training
state, gathered weights and activations with no engine, and at the update's end the weight push
wakes the engine's weights beside the training state (its KV cache still freed): `weight_push`. On
CPU vLLM refuses sleep mode, so the engine keeps its weights and cache through the update. During
generation the training state stays on the device unless training.resharding is allgather_swap
(swapped to the host) or training.fsdp_cpu_offload (it lives on the host).

The PPO critic (ppo, pf_ppo): one rank per data-parallel rank. Under strategy ddp (or a lone rank)
each holds a full replica of the value model (the policy's body without its LM head, plus a
one-output head) with its gradients and AdamW state, never swapped, plus its activations in the
update (one micro-batch, no logits; training.gradient_checkpointing applies as for the actor).
Under strategy fsdp with more than one rank the value model is sharded as the actor is: params and
AdamW state divided by the data-parallel size (on the host with training.fsdp_cpu_offload), two
gathered layers plus the root (its token embedding) in the compute dtype, activations in the
compute dtype. Its micro-batches accumulate gradients without a sync (FSDP2's
set_requires_gradient_sync), which keeps each parameter's whole gradient on the device until the
step's reduce-scatter: in the update gradients are counted whole when a rank's mini-batch spans
more than one micro-batch, else sharded like the params; in generation the gradient shards stay.
Critic ranks never share a device with each other (rldock.contract.placement); a critic rank's
device holds it alone, or beside an actor rank in a colocated job whose actor devices have a half
left (`CriticBytes.beside_actor`), and then the two add up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rldock.config import JobConfig
from rldock.config.job_layout import job_layout
from rldock.config.rollout import generation_dtype
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import memory_models, placement_plan
from rldock.runtime.planning.context_parallel_bytes import (
    context_bytes_per_pass,
    mask_bytes,
    saved_width,
    tokens_per_rank,
)
from rldock.runtime.planning.shapes import ModelShape

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMPUTE_BYTES = {"bf16": 2, "fp16": 2}
MIXED_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # training.mixed_precision's compute dtype


@dataclass(frozen=True)
class PhaseBytes:
    """Device bytes by category in one phase; `host` is what the device's workers keep in host
    memory (training state swapped or offloaded, engine weights a level-1 sleep offloaded)."""

    params: int = 0
    grads: int = 0
    optimizer_state: int = 0
    fsdp_gathered: int = 0
    fsdp_whole_grads: int = 0  # gradients FSDP holds whole beside the shards in `grads` (fsdp_whole_gradient_bytes)
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
class CriticBytes:
    """One PPO critic rank's device bytes, and whether its device also holds an actor rank."""

    update: PhaseBytes
    generation: PhaseBytes
    beside_actor: bool

    @property
    def peak(self) -> int:
        return max(self.update.device_total, self.generation.device_total)


@dataclass(frozen=True)
class MoePlan:
    """An MoE model's figures beside the bytes: parameters, this rank's expert shard, the all-to-all."""

    num_experts: int
    top_k: int
    active_params: int
    expert_parallel_size: int
    experts_per_rank: int  # each MoE layer's experts one EP rank holds
    expert_bytes_per_rank: int  # their parameter bytes over all layers, before FSDP's 1/(dp/ep)
    all_to_all_bytes: int  # what one rank sends per update micro-batch: dispatch and combine, every layer, forward
    # (a CP rank: its 1/cp of the positions)
    redundant: RedundantWeights


@dataclass(frozen=True)
class RedundantWeights:
    """The paper's eq. 3 with experts: the training weights naive resharding leaves on the devices
    during generation, beside the engine's, counted over the generation replicas (one device each:
    an engine's first rank, `JobLayout.engine_ranks`).

    MindSpeed RL writes R = GDP * (TW/UTP + EW/GEP): GDP generation replicas, TW the weights split
    by tensor parallelism (everything but the experts: attention, embeddings, norms, routers), EW the
    expert weights, UTP the update's TP and GEP the expert split (its update and generation EP are
    one size). `paper_bytes` is that figure with rldock's sizes: UTP training.tensor_parallel_size,
    GEP the generation's expert split, rollout.tensor_parallel_size (vLLM splits experts by its TP;
    rldock runs no engine EP). rldock's training layout splits further, so what its naive resharding
    leaves (`naive_bytes`) is R with the update's own splits: TW over UTP x the FSDP shards, EW over
    training.expert_parallel_size x the expert-data-parallel FSDP shards (every rank holds 1/dp of
    either under FSDP). allgather_swap leaves none: the training state goes to the host."""

    generation_replicas: int  # GDP
    generation_expert_split: int  # GEP
    dense_weight_bytes: int  # TW
    expert_weight_bytes: int  # EW
    dense_split: int  # the update's split of TW on a device: UTP (x FSDP's shards)
    expert_split: int  # the update's split of EW on a device: EP (x FSDP's expert-data-parallel shards)
    paper_bytes: int  # GDP * (TW/UTP + EW/GEP)
    naive_bytes: int  # GDP * (TW/dense_split + EW/expert_split): training.resharding naive


def plan_redundant_weights(cfg: JobConfig, shape: ModelShape) -> RedundantWeights:
    """Eq. 3 with experts for `cfg` and `shape` (RedundantWeights)."""
    training, layout = cfg.training, job_layout(cfg)
    element = DTYPE_BYTES[cfg.model.dtype]
    experts = shape.num_layers * shape.expert_params * element
    dense = shape.num_params * element - experts
    fsdp = training.strategy == "fsdp"
    dense_split = training.tensor_parallel_size * (fsdp_shard_ranks(cfg) if fsdp else 1)
    expert_split = layout.ep * (layout.expert_data_parallel if fsdp else 1)
    gdp, gep = layout.num_generation_replicas, layout.generation_tp
    return RedundantWeights(
        generation_replicas=gdp,
        generation_expert_split=gep,
        dense_weight_bytes=dense,
        expert_weight_bytes=experts,
        dense_split=dense_split,
        expert_split=expert_split,
        paper_bytes=gdp * (dense // training.tensor_parallel_size + experts // gep),
        naive_bytes=gdp * (dense // dense_split + experts // expert_split),
    )


def plan_moe(cfg: JobConfig, shape: ModelShape) -> MoePlan | None:
    """The MoE figures of `cfg` with `shape`; None for a dense model. The all-to-all moves each of a
    micro-batch's tokens' k copies to their experts and the outputs back (2 x tokens x k x h
    elements per layer), of which the share (ep - 1) / ep leaves the rank when experts are spread
    evenly; the backward moves as much again. Under CP a rank routes its ceil(tokens / cp) positions
    only (EP groups are carved out of the dp x cp ranks, rldock.contract.layout)."""
    if not shape.is_moe:
        return None
    ep, cp = cfg.training.expert_parallel_size, cfg.training.context_parallel_size
    element = COMPUTE_BYTES.get(cfg.training.mixed_precision, DTYPE_BYTES[cfg.model.dtype])
    tokens = -(-_micro_batch_tokens(cfg) // cp)  # this rank's positions of the micro-batch
    sent = 2 * tokens * shape.num_experts_per_tok * shape.hidden_size * element
    return MoePlan(
        num_experts=shape.num_experts,
        top_k=shape.num_experts_per_tok,
        active_params=shape.active_params,
        expert_parallel_size=ep,
        experts_per_rank=shape.num_experts // ep,
        expert_bytes_per_rank=shape.num_layers * shape.expert_params // ep * DTYPE_BYTES[cfg.model.dtype],
        all_to_all_bytes=shape.num_layers * sent * (ep - 1) // ep,
        redundant=plan_redundant_weights(cfg, shape),
    )


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
    weight_push: int  # device bytes while the update's end pushes weights into the woken engine
    engine_sleeps: bool  # the engine sleeps through the update (an accelerator)
    critic: CriticBytes | None = None
    context_parallel_size: int = 1
    all_to_all_bytes: int = 0  # what a CP rank sends its group in one update step (update_all_to_all_bytes)
    moe: MoePlan | None = None

    @property
    def actor_peak(self) -> int:
        return max(self.update.device_total, self.generation.device_total, self.weight_push)

    @property
    def peak(self) -> int:
        """The fullest device: an actor rank's, a critic rank's, or both where they share one."""
        critic = self.critic
        if critic is None:
            return self.actor_peak
        if not critic.beside_actor:
            return max(self.actor_peak, critic.peak)
        return max(
            self.update.device_total + critic.update.device_total,
            self.generation.device_total + critic.generation.device_total,
            self.weight_push + critic.update.device_total,
        )


def fsdp_shard_ranks(cfg: JobConfig) -> int:
    """The ranks FSDP shards a tensor over: the DP x CP sequence ranks (training/context_parallel.py), those
    of one replica under HSDP (training.data_parallel_replicate_size)."""
    return job_layout(cfg).num_sequence_ranks // cfg.training.data_parallel_replicate_size


def training_state_bytes(cfg: JobConfig, shape: ModelShape) -> tuple[int, int, int]:
    """(params, grads, optimizer state) bytes one actor rank holds."""
    training = cfg.training
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    tp = training.tensor_parallel_size
    shard = fsdp_shard_ranks(cfg) if training.strategy == "fsdp" else 1
    vocab = shape.embedding_params
    # TP splits the decoder layers' weights only, and of an MoE layer not the experts (EP's, beside TP)
    layers = shape.num_layers * ((shape.layer_params - shape.expert_params) // tp + shape.expert_params)
    params = vocab + layers + shape.hidden_size
    trainable = params - (vocab if training.freeze_embeddings else 0)
    return (
        -(-params * param_bytes // shard),
        -(-trainable * param_bytes // shard),
        -(-2 * trainable * param_bytes // shard),
    )


def fsdp_whole_gradient_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """The gradient bytes an FSDP rank holds whole during the backward, beyond the shards that
    `training_state_bytes` counts (module docstring): the LM head's whole gradient in the compute
    dtype in place of its shard (none with training.freeze_embeddings), plus one layer's
    reduce-scatter input (its whole gradient in the reduce dtype; under EP the layer's own experts,
    as `fsdp_gathered` counts them), on the device with training.fsdp_cpu_offload too. 0 without FSDP."""
    training = cfg.training
    if training.strategy != "fsdp":
        return 0
    param_bytes = DTYPE_BYTES[cfg.model.dtype]  # FSDP reduces in float32 under mixed precision: the shards' dtype
    compute = COMPUTE_BYTES.get(training.mixed_precision, param_bytes)
    shard = fsdp_shard_ranks(cfg)
    head = 0 if training.freeze_embeddings else shape.vocab_size * shape.hidden_size
    layer = shape.layer_params - shape.expert_params + shape.expert_params // training.expert_parallel_size
    # the head's shard, counted in the device's gradients unless they live on the host (fsdp_cpu_offload)
    head_shard = 0 if training.fsdp_cpu_offload else -(-head * param_bytes // shard)
    return head * compute - head_shard + layer * param_bytes


def _dispatch_width(shape: ModelShape) -> int:
    """An MoE layer's dispatch keeps, per token, its k copies sent to the experts and the k outputs
    combined back (engines/expert_parallel.py: what the all-to-alls move); 0 for a dense layer."""
    return 2 * shape.num_experts_per_tok * shape.hidden_size if shape.is_moe else 0


def _layer_activation_bytes(
    shape: ModelShape, *, tokens: int, element: int, tp: int, cp: int = 1, mode: str = "ulysses"
) -> int:
    """What autograd keeps of one decoder layer for a pass of `tokens` tokens on one rank (module
    docstring); a CP rank keeps about as much per position for 1/cp of them, plus what its mode's
    attention keeps (planning/context_parallel_bytes.py)."""
    h, d = shape.hidden_size, shape.head_dim
    per_token = (
        4 * h
        + ((shape.num_heads + 2 * shape.num_kv_heads) * d + shape.num_heads * d) // tp
        + 4 * shape.active_intermediate // (1 if shape.is_moe else tp)  # TP leaves the experts whole
        + _dispatch_width(shape)
        + saved_width(shape, mode=mode, cp=cp, element=element)
    )
    return tokens_per_rank(tokens, cp) * per_token * element


# engines/head_logprobs.py's CHUNK_BYTES (a test keeps them equal; the planner imports no torch)
LOGIT_CHUNK_BYTES = 32 << 20


def _micro_batch_tokens(cfg: JobConfig) -> int:
    """The most tokens one pass computes: micro_batch_size whole sequences, within micro_batch_tokens."""
    sequence = cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length
    tokens = cfg.training.micro_batch_size * sequence
    budget = cfg.training.micro_batch_tokens
    return tokens if budget is None else max(min(tokens, budget), sequence)


def _decoder_activation_bytes(cfg: JobConfig, shape: ModelShape, *, element: int, tp: int) -> int:
    """What the decoder layers keep for one micro-batch, with or without gradient checkpointing, on
    one rank (a CP rank: its 1/cp of the positions and a pass's whole 4D mask,
    planning/context_parallel_bytes.py)."""
    tokens, cp = _micro_batch_tokens(cfg), cfg.training.context_parallel_size
    mode = cfg.training.context_parallel_mode
    per_layer = _layer_activation_bytes(shape, tokens=tokens, element=element, tp=tp, cp=cp, mode=mode)
    # A pass of one trimmed row has no padding and no mask (causal); otherwise at most a packed row's.
    masked = cfg.training.micro_batch_size > 1 or not cfg.training.trim_padding
    mask = mask_bytes(rows=1, sequence=tokens, cp=cp) if masked else 0
    if cfg.training.gradient_checkpointing:
        return shape.num_layers * tokens_per_rank(tokens, cp) * shape.hidden_size * element + per_layer + mask
    return shape.num_layers * per_layer + mask


def activation_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """The update's activations for one micro-batch (see the module docstring for the formula)."""
    training = cfg.training
    element = COMPUTE_BYTES.get(training.mixed_precision, DTYPE_BYTES[cfg.model.dtype])
    layers = _decoder_activation_bytes(cfg, shape, element=element, tp=training.tensor_parallel_size)
    return layers + head_chunk_bytes(cfg, shape)


def head_chunk_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """The LM head's working set: about three float32 (chunk, V) tensors, a chunk being the positions
    whose logits fit in LOGIT_CHUNK_BYTES, or the pass's tokens when fewer."""
    tokens = tokens_per_rank(_micro_batch_tokens(cfg), cfg.training.context_parallel_size)  # a CP rank's positions
    chunk = min(tokens, max(1, LOGIT_CHUNK_BYTES // (4 * shape.vocab_size)))
    return 3 * chunk * shape.vocab_size * 4


def update_all_to_all_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """Bytes a CP rank sends the other ranks of its group in one update step: every micro-batch of
    its mini-batch a forward and a backward (and a recomputed forward with gradient checkpointing)
    of the longest sequences (planning/context_parallel_bytes.py). 0 without CP."""
    training = cfg.training
    element = COMPUTE_BYTES.get(training.mixed_precision, DTYPE_BYTES[cfg.model.dtype])
    mini_batch = cfg.num_samples_per_iteration // training.data_parallel_size // cfg.algorithm.num_updates_per_iteration
    rows_per_pass = _micro_batch_tokens(cfg) // (cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length)
    passes = -(-mini_batch // max(1, min(rows_per_pass, training.micro_batch_size)))
    per_pass = context_bytes_per_pass(
        shape,
        mode=training.context_parallel_mode,
        tokens=_micro_batch_tokens(cfg),
        cp=training.context_parallel_size,
        element=element,
        recompute=training.gradient_checkpointing,
    )
    return passes * per_pass


def critic_params(shape: ModelShape) -> int:
    """The value model's parameters: the policy's body (its token embedding kept, the LM head dropped
    unless tied to it) and a value head of hidden_size weights and a bias."""
    lm_head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return shape.num_params - lm_head + shape.hidden_size + 1


def critic_is_sharded(cfg: JobConfig) -> bool:
    """Whether the critic ranks shard the value model (FSDP over more than one rank: DP x CP)."""
    return cfg.training.strategy == "fsdp" and fsdp_shard_ranks(cfg) > 1


def plan_critic(cfg: JobConfig, shape: ModelShape) -> CriticBytes | None:
    """One critic rank's device bytes (module docstring); None when the algorithm has no critic."""
    if "critic" not in memory_models(job_recipe(cfg).specs):
        return None
    training = cfg.training
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    params = critic_params(shape) * param_bytes
    values = _micro_batch_tokens(cfg) * 4  # float32 values (a CP rank holds all of them, summed over its group)
    beside = _critic_beside_actor(cfg)
    if not critic_is_sharded(cfg):  # a full replica (DDP, or one rank) computing in model.dtype
        activations = _decoder_activation_bytes(cfg, shape, element=param_bytes, tp=1) + values
        state = (params, params, 2 * params)  # params, grads, AdamW's two moments
        return CriticBytes(
            update=PhaseBytes(*state, activations=activations), generation=PhaseBytes(*state), beside_actor=beside
        )
    dp = fsdp_shard_ranks(cfg)  # FSDP over DP x CP ranks (a replica's under HSDP)
    element = COMPUTE_BYTES.get(training.mixed_precision, param_bytes)
    activations = _decoder_activation_bytes(cfg, shape, element=element, tp=1) + values
    gathered = (2 * shape.layer_params + shape.vocab_size * shape.hidden_size) * element
    mini_batch = cfg.num_samples_per_iteration // training.data_parallel_size // cfg.algorithm.num_updates_per_iteration
    accumulates = mini_batch > training.micro_batch_size  # whole gradients kept between micro-batches
    sharded = (-(-params // dp), -(-params // dp), -(-2 * params // dp))
    # After the step's reduce-scatter only the gradient shards stay (to the next step's zero_grad).
    if training.fsdp_cpu_offload:  # the shards live on the host; accumulated whole gradients do not
        host = sum(sharded)
        after = (0, 0, 0)
    else:
        host, after = 0, sharded
    update = (after[0], params if accumulates else after[1], after[2])
    return CriticBytes(
        update=PhaseBytes(*update, fsdp_gathered=gathered, activations=activations, host=host),
        generation=PhaseBytes(*after, host=host),
        beside_actor=beside,
    )


def _critic_beside_actor(cfg: JobConfig) -> bool:
    """Whether the job's placement (its recipe's worker states, rldock.runtime.flow.states) seats a
    critic rank on an actor rank's device."""
    # Planned for one DP rank: the answer does not depend on the DP size (each DP rank brings its
    # tp actor devices, its reference and its critic alike), and the verdict's search re-plans at
    # thousands of ranks, where the first-fit placement would take seconds.
    plan = placement_plan(cfg, job_recipe(cfg).specs, data_parallel_size=1)
    return any(seat.bundle < len(plan.actors) for seat in plan.group("critic"))  # actor rank i sits on bundle i


def engine_dtype(cfg: JobConfig) -> str:
    """The dtype the job's vLLM engine holds its weights in (rollout.dtype, else model.dtype; float32 on CPU)."""
    return generation_dtype(
        model_dtype=cfg.model.dtype, rollout_dtype=cfg.rollout.dtype, on_cpu=cfg.resources.device == "cpu"
    )


def training_dtype(cfg: JobConfig) -> str:
    """The dtype the training backends' passes compute in: training.mixed_precision's (FSDP casts the
    float32 master weights for each forward and backward), else model.dtype."""
    return MIXED_PRECISION_DTYPES.get(cfg.training.mixed_precision, cfg.model.dtype)


def compute_dtypes(cfg: JobConfig) -> tuple[str, str, str]:
    """The dtypes the job's passes compute in: the rollout's (`engine_dtype`), the training
    backends' (`training_dtype`) and the reference's (model.dtype: the reference ranks run no mixed
    precision, and under LoRA the actors that run it are DDP ranks, which have none either)."""
    return engine_dtype(cfg), training_dtype(cfg), cfg.model.dtype


def _engine_bytes(cfg: JobConfig, shape: ModelShape, device_memory: int | None) -> tuple[int, int]:
    """(generation weights, KV cache) per device of the replica's vLLM engine (split over its TP)."""
    weights = shape.num_params * DTYPE_BYTES[engine_dtype(cfg)] // job_layout(cfg).generation_tp
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
        # a layer gathers its experts over the expert-data-parallel group only: this rank's E/ep of them
        layer = shape.layer_params - shape.expert_params + shape.expert_params // training.expert_parallel_size
        gathered = (2 * layer + shape.embedding_params) * element
    offloaded = training.strategy == "fsdp" and training.fsdp_cpu_offload
    state = (0, 0, 0) if offloaded else (params, grads, optimizer)
    host = params + grads + optimizer if offloaded else 0
    sleeps = cfg.resources.device != "cpu"  # vLLM refuses sleep mode on CPU
    # asleep: no KV cache; the weights in host memory at level 1, discarded at level 2
    update_engine = (0, 0, weights if cfg.rollout.sleep_level == 1 else 0) if sleeps else (weights, kv_cache, 0)
    update = PhaseBytes(
        *state,
        fsdp_gathered=gathered,
        fsdp_whole_grads=fsdp_whole_gradient_bytes(cfg, shape),
        activations=activation_bytes(cfg, shape),
        generation_weights=update_engine[0],
        kv_cache=update_engine[1],
        host=host + update_engine[2],
    )
    # the update's end: the engine's weights wake (KV cache still freed) and take the new ones
    weight_push = sum(state) + weights + (0 if sleeps else kv_cache)
    swapped = training.resharding == "allgather_swap"
    generation = PhaseBytes(
        *((0, 0, 0) if swapped else state),
        generation_weights=weights,
        kv_cache=kv_cache,
        host=host + (params + grads + optimizer if swapped and not offloaded else 0),
    )
    return MemoryPlan(
        model=shape.name,
        num_params=shape.num_params,
        strategy=training.strategy,
        data_parallel_size=training.data_parallel_size,
        tensor_parallel_size=training.tensor_parallel_size,
        update=update,
        generation=generation,
        device_memory=device_memory,
        weight_push=weight_push,
        engine_sleeps=sleeps,
        critic=plan_critic(cfg, shape),
        context_parallel_size=training.context_parallel_size,
        all_to_all_bytes=update_all_to_all_bytes(cfg, shape),
        moe=plan_moe(cfg, shape),
        # a device holds 1/TP of the KV heads
        kv_cache_tokens=kv_cache
        * job_layout(cfg).generation_tp
        // shape.kv_bytes_per_token(DTYPE_BYTES[engine_dtype(cfg)]),
    )
