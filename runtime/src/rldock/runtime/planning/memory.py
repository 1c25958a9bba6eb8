"""Per-device bytes of one actor rank in the training (update) and generation phases.

Every figure is arithmetic on the config and the model shape (bytes, no torch), computed in
planning/training_state.py, activations.py, moe_bytes.py and pipeline_stages.py (the units in
dtypes.py) and put together here:

- parameters: P x param bytes (model.dtype; float32 masters under mixed precision), divided by the
  data-parallel size under FSDP and the TP size for the decoder layers' linears under TP (their norms,
  and an MoE layer's router and experts, whole on every TP rank: `layer_params_per_tp_rank`).
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
  and the next layer's are prefetched: 2 x layer params (a TP rank's slices under TP: FSDP gathers
  over the data-parallel ranks only), plus the root's (embeddings, LM head), which stay gathered
  through the forward/backward. Under expert parallelism a layer gathers only
  its EP rank's experts (1/expert_parallel_size of them); params, gradients and optimizer state
  per rank are the same 1/dp either way (experts over ep x dp/ep ranks, the rest over dp).
- activations (an estimate) for one micro-batch of b = training.micro_batch_size sequences of
  s = max_prompt_length + max_response_length tokens, e bytes per compute element: per layer the
  tensors autograd keeps, b*s*(4h + (n_q + 2 n_kv) d + n_q d + 4 I) x e (each of the two norms'
  normalised product and weighted output, q/k/v, the attention output, the MLP's gate, up, activation
  and product; attention scores not kept, as with fused/flash attention) plus b*s*(8(h + 1) + 4 n_q)
  bytes kept in float32 whatever e (each norm computes in float32 and keeps its input and reciprocal
  root; the attention kernel a log-sum-exp per head), times L layers: every byte saved-tensor hooks
  count on a Qwen2 layer but the rotary cos and sin all layers share, in float32 and bfloat16 alike
  (docs/scaling.md, section 12); with
  training.gradient_checkpointing only each layer's input b*s*h x e is kept, plus one layer's
  full set while it is recomputed. An MoE layer's MLP terms count the k experts a token runs
  (4 k I_moe) and its dispatch 2 k h (the token's k copies and the k outputs). With
  training.micro_batch_tokens a pass computes at most that
  many tokens (b*s when smaller; one whole sequence s when larger). Beside what autograd keeps, the
  transient at the update's fullest moment (`stage_working_bytes`): the larger of the LM head's chunk,
  about three float32 (chunk, V) tensors whatever b*s*V is (it runs on a chunk of scored positions at
  a time, engines/head_logprobs.py, the positions whose logits fit in LOGIT_CHUNK_BYTES, 32 MiB), and
  a layer's backward working set, b*s*(h + 2 I) x e (`backward_working_bytes`: the residual stream's
  gradient and the MLP's three I-wide gradients less the down projection's input, which autograd has
  freed by then; under ring attention the larger of that MLP term and a backward step's two (H, t, t)
  float32 score tiles with its O(n) gradients and key-and-value blocks in transit). The head's backward
  is done before the layers' starts, so the two are never live together (docs/scaling.md, sections 9
  and 12).
- context parallelism (training.context_parallel_size): a rank computes and keeps 1/cp of a
  pass's tokens (Ulysses: its attention's tensors head-sharded over the whole sequence, as many
  elements, plus the kernel's output apart from the exchanged one the projection keeps: n_q d per
  token; ring: its own positions' q, k, v, plus the float32 merged output and log-sum-exps), and
  holds the pass's whole 4D mask unless the pass is one trimmed row (causal, no mask); FSDP shards
  the training state over DP x CP ranks; `all_to_all_bytes` is what a rank sends its CP group in one
  update step, by the mode's traffic (planning/context_parallel_bytes.py).
- pipeline parallelism (training.pipeline_parallel_size p; planning/pipeline_stages.py): a rank
  holds its stage's training state, the heaviest stage's counted (its share of the layers as
  split above, plus the embedding on stage 0, the final norm and the head on the last; V x h
  each, a tied model's last stage holding a copy), sharded by FSDP over its stage's dp x cp ranks;
  the root a stage gathers is its one vocabulary matrix. The update's m micro-batches (a rank's
  mini-batch over training.micro_batch_size rows, `update_micro_batches`) run 1F1B: stage s holds
  min(p - s, m) micro-batches' activations of its layers at once, the last adds the head's chunk;
  a stage before the last also keeps each held micro-batch's output (T x h), which its backward
  starts from and autograd does not save, and at its peak (its last layer's backward under the next
  micro-batch's activations) a layer's backward working set, T x (h + 2 I) in the compute dtype
  (`backward_working_bytes`, above). The fullest stage's are counted (stage 0's but for a small
  pass); the last stage's transient is the larger of the head's chunk and that working set, as
  without PP.
  `pipeline_bubble` is the step's idle share, (p - 1) / (m + p - 1). Each figure is its fullest
  stage's, so the sum bounds every stage's device from above. At p = 1 the one stage holds everything, as without PP.
- generation weights: the model in the engine's dtype (rollout.dtype, else model.dtype) over
  rollout.tensor_parallel_size devices (one vLLM engine per generation replica, its weights split
  by vLLM's TP; the whole model at TP 1).
- KV cache: on an accelerator vLLM takes rollout.gpu_memory_utilization of the device and keeps
  what its weights leave as cache; on CPU, rollout.cpu_kv_cache_gib, else what the job's sequences
  need at most 1 GiB (planning/cpu_kv_cache.py).

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
update (one micro-batch, no logits, so a layer's backward working set is its transient;
training.gradient_checkpointing applies as for the actor).
Under strategy fsdp with more than one rank the value model is sharded as the actor is: params and
AdamW state divided by the data-parallel size (on the host with training.fsdp_cpu_offload), two
gathered layers plus the root (its token embedding) in the compute dtype, activations in the
compute dtype. Its micro-batches accumulate gradients without a sync (FSDP2's
set_requires_gradient_sync), which keeps each parameter's whole gradient on the device until the
step's reduce-scatter: in the update gradients are counted whole when a rank's mini-batch spans
more than one micro-batch, else sharded like the params; in generation the gradient shards stay.
Under PP the critic's value model is cut into the actor's stages and a critic rank is planned as its fullest
stage's: that stage's layers (the embedding on the first, the final norm and the value head on the last)
under FSDP over the stage's ranks, and its layers' activations for the micro-batches 1F1B holds there (with
their outputs before the last stage, and a layer's backward working set, as an actor stage's).
Critic ranks never share a device with each other (rldock.contract.placement); a critic rank's
device holds it alone, or beside an actor rank in a colocated job whose actor devices have a half
left (`CriticBytes.beside_actor`), and then the two add up.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rldock.config import JobConfig
from rldock.config.job_layout import job_layout
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import memory_models, placement_plan
from rldock.runtime.planning.activations import (
    LOGIT_CHUNK_BYTES,
    activation_bytes,
    backward_working_bytes,
    decoder_activation_bytes,
    final_norm_bytes,
    head_chunk_bytes,
    micro_batch_tokens,
    stage_activation_bytes,
    stage_output_bytes,
    stage_saved_bytes,
    stage_working_bytes,
    update_all_to_all_bytes,
    update_micro_batches,
)
from rldock.runtime.planning.cpu_kv_cache import cpu_kv_cache_bytes
from rldock.runtime.planning.dtypes import (
    COMPUTE_BYTES,
    DTYPE_BYTES,
    GIB,
    MIXED_PRECISION_DTYPES,
    compute_dtypes,
    compute_element_bytes,
    engine_dtype,
    training_dtype,
)
from rldock.runtime.planning.moe_bytes import MoePlan, RedundantWeights, plan_moe, plan_redundant_weights
from rldock.runtime.planning.pipeline_stages import (
    micro_batches_held,
    pipeline_bubble,
    stage_layer_counts,
    stage_layers,
)
from rldock.runtime.planning.shapes import ModelShape
from rldock.runtime.planning.training_state import (
    fsdp_gathered_bytes,
    fsdp_shard_ranks,
    fsdp_whole_gradient_bytes,
    layers_params_per_tp_rank,
    stage_training_state_bytes,
    training_state_bytes,
)

# The planner's figures by their first home, here for the modules and tests that import them from this one.
__all__ = [
    "COMPUTE_BYTES",
    "DTYPE_BYTES",
    "GIB",
    "LOGIT_CHUNK_BYTES",
    "MIXED_PRECISION_DTYPES",
    "CriticBytes",
    "MemoryPlan",
    "MoePlan",
    "PhaseBytes",
    "RedundantWeights",
    "activation_bytes",
    "backward_working_bytes",
    "compute_dtypes",
    "critic_is_sharded",
    "critic_params",
    "engine_dtype",
    "final_norm_bytes",
    "fsdp_gathered_bytes",
    "fsdp_shard_ranks",
    "fsdp_whole_gradient_bytes",
    "head_chunk_bytes",
    "plan_critic",
    "plan_memory",
    "plan_moe",
    "plan_redundant_weights",
    "stage_activation_bytes",
    "stage_output_bytes",
    "stage_saved_bytes",
    "stage_training_state_bytes",
    "stage_working_bytes",
    "training_dtype",
    "training_state_bytes",
    "update_all_to_all_bytes",
    "update_micro_batches",
]


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
    sharded: bool = False  # under FSDP (critic_is_sharded), else a whole replica

    @property
    def peak(self) -> int:
        return max(self.update.device_total, self.generation.device_total)


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
    pipeline_parallel_size: int = 1
    micro_batches: int = 1  # m: the update's micro-batches per mini-batch on a data-parallel rank
    pipeline_bubble: float = 0.0  # the idle share of an update step under 1F1B: (p - 1) / (m + p - 1)

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


def critic_params(shape: ModelShape) -> int:
    """The value model's parameters: the policy's body (its token embedding kept, the LM head dropped
    unless tied to it) and a value head of hidden_size weights and a bias."""
    lm_head = 0 if shape.tie_word_embeddings else shape.vocab_size * shape.hidden_size
    return shape.num_params - lm_head + shape.hidden_size + 1


def critic_stage_params(shape: ModelShape, *, stage: int, stages: int) -> int:
    """The value model's parameters on pipeline stage `stage` of `stages` (all of them at one stage): its
    decoder layers (planning/pipeline_stages.py's split, the policy's), the token embedding on the first,
    the final norm and the value head on the last."""
    if stages == 1:
        return critic_params(shape)
    layers = layers_params_per_tp_rank(shape, stage_layers(shape.num_layers, stage=stage, stages=stages), tp=1)
    embedding = shape.vocab_size * shape.hidden_size if stage == 0 else 0
    return layers + embedding + (2 * shape.hidden_size + 1 if stage == stages - 1 else 0)


def critic_is_sharded(cfg: JobConfig) -> bool:
    """Whether the critic ranks hold the value model under FSDP (more than one rank, or pipeline stages: DP x CP
    ranks a stage); else a whole replica (DDP, or one rank)."""
    training = cfg.training
    return training.strategy == "fsdp" and (fsdp_shard_ranks(cfg) > 1 or training.pipeline_parallel_size > 1)


def plan_critic(cfg: JobConfig, shape: ModelShape) -> CriticBytes | None:
    """One critic rank's device bytes (module docstring), under PP the fullest stage's; None when the algorithm
    has no critic."""
    if "critic" not in memory_models(job_recipe(cfg).specs):
        return None
    beside = _critic_beside_actor(cfg)
    stages = range(cfg.training.pipeline_parallel_size)
    return max((_plan_critic_stage(cfg, shape, stage, beside=beside) for stage in stages), key=lambda c: c.peak)


def _plan_critic_stage(cfg: JobConfig, shape: ModelShape, stage: int, *, beside: bool) -> CriticBytes:
    """A critic rank of pipeline stage `stage` (0 without PP): its stage's value-model state, and the update's
    activations of its layers for the micro-batches 1F1B holds there at once."""
    training = cfg.training
    stages = training.pipeline_parallel_size
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    params = critic_stage_params(shape, stage=stage, stages=stages) * param_bytes
    values = micro_batch_tokens(cfg) * 4  # float32 values (a CP rank holds all of them, summed over its group)
    last = stage == stages - 1  # the final norm and the value head
    held = micro_batches_held(stage=stage, stages=stages, micro_batches=max(1, update_micro_batches(cfg)))
    layers = stage_layer_counts(shape.num_layers, stages)[stage]
    if not critic_is_sharded(cfg):  # a full replica (DDP, or one rank) computing in model.dtype
        activations = decoder_activation_bytes(cfg, shape, element=param_bytes, tp=1) + values
        activations += final_norm_bytes(cfg, shape, element=param_bytes) if last else 0
        activations += backward_working_bytes(cfg, shape, element=param_bytes, tp=1)  # no LM head's chunk
        state = (params, params, 2 * params)  # params, grads, AdamW's two moments
        return CriticBytes(
            update=PhaseBytes(*state, activations=activations), generation=PhaseBytes(*state), beside_actor=beside
        )
    dp = fsdp_shard_ranks(cfg)  # FSDP over DP x CP ranks (a replica's under HSDP; a stage's under PP)
    element = compute_element_bytes(cfg)
    activations = decoder_activation_bytes(cfg, shape, element=element, tp=1, layers=layers, held=held) + values
    activations += final_norm_bytes(cfg, shape, element=element) if last else 0
    # as an actor stage's: the held outputs before the last stage, and a layer's backward working set (no head)
    activations += stage_output_bytes(cfg, shape, stage) + backward_working_bytes(cfg, shape, element=element, tp=1)
    embedding = shape.vocab_size * shape.hidden_size if stage == 0 else 0  # the root's, on the first stage
    gathered = (2 * shape.layer_params + embedding) * element
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
        sharded=True,
    )


def _critic_beside_actor(cfg: JobConfig) -> bool:
    """Whether the job's placement (its recipe's worker states, rldock.runtime.flow.states) seats a
    critic rank on an actor rank's device."""
    # Planned for one DP rank: the answer does not depend on the DP size (each DP rank brings its
    # tp actor devices, its reference and its critic alike), and the verdict's search re-plans at
    # thousands of ranks, where the first-fit placement would take seconds.
    plan = placement_plan(cfg, job_recipe(cfg).specs, data_parallel_size=1)
    return any(seat.bundle < len(plan.actors) for seat in plan.group("critic"))  # actor rank i sits on bundle i


def _engine_bytes(cfg: JobConfig, shape: ModelShape, device_memory: int | None) -> tuple[int, int]:
    """(generation weights, KV cache) per device of the replica's vLLM engine (split over its TP)."""
    weights = shape.num_params * DTYPE_BYTES[engine_dtype(cfg)] // job_layout(cfg).generation_tp
    if cfg.resources.device == "cpu" or device_memory is None:
        cache = cpu_kv_cache_bytes(
            cfg.rollout,
            shape,
            dtype_bytes=DTYPE_BYTES[engine_dtype(cfg)],
            generation_tp=job_layout(cfg).generation_tp,
            max_model_len=cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length,
        )
        return weights, cache
    return weights, max(0, int(cfg.rollout.gpu_memory_utilization * device_memory) - weights)


def plan_memory(cfg: JobConfig, shape: ModelShape, *, device_memory: int | None = None) -> MemoryPlan:
    """The per-device bytes of `cfg` with `shape`; `device_memory` (bytes) defaults to the config's."""
    if device_memory is None and cfg.resources.device_memory_gib is not None:
        device_memory = int(cfg.resources.device_memory_gib * GIB)
    training = cfg.training
    params, grads, optimizer = training_state_bytes(cfg, shape)
    weights, kv_cache = _engine_bytes(cfg, shape, device_memory)
    micro_batches = max(1, update_micro_batches(cfg))
    offloaded = training.strategy == "fsdp" and training.fsdp_cpu_offload
    state = (0, 0, 0) if offloaded else (params, grads, optimizer)
    host = params + grads + optimizer if offloaded else 0
    sleeps = cfg.resources.device != "cpu"  # vLLM refuses sleep mode on CPU
    # asleep: no KV cache; the weights in host memory at level 1, discarded at level 2
    update_engine = (0, 0, weights if cfg.rollout.sleep_level == 1 else 0) if sleeps else (weights, kv_cache, 0)
    update = PhaseBytes(
        *state,
        fsdp_gathered=fsdp_gathered_bytes(cfg, shape),
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
        pipeline_parallel_size=training.pipeline_parallel_size,
        micro_batches=micro_batches,
        pipeline_bubble=pipeline_bubble(stages=training.pipeline_parallel_size, micro_batches=micro_batches),
        # a device holds 1/TP of the KV heads
        kv_cache_tokens=kv_cache
        * job_layout(cfg).generation_tp
        // shape.kv_bytes_per_token(DTYPE_BYTES[engine_dtype(cfg)]),
    )
