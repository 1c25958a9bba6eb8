"""The update's activations on one actor rank, its micro-batches and its CP traffic (the formulas:
planning/memory.py's module docstring; planning/memory.py re-exports these)."""

from __future__ import annotations

from rldock.config import JobConfig
from rldock.runtime.planning.context_parallel_bytes import (
    context_bytes_per_pass,
    mask_bytes,
    ring_block_bytes,
    saved_width,
    tokens_per_rank,
)
from rldock.runtime.planning.dtypes import compute_element_bytes
from rldock.runtime.planning.pipeline_stages import micro_batches_held, stage_layer_counts
from rldock.runtime.planning.shapes import ModelShape

# engines/head_logprobs.py's CHUNK_BYTES (a test keeps them equal; the planner imports no torch)
LOGIT_CHUNK_BYTES = 32 << 20


def _dispatch_width(shape: ModelShape) -> int:
    """An MoE layer's dispatch keeps, per token, its k copies sent to the experts and the k outputs
    combined back (engines/expert_parallel.py: what the all-to-alls move); 0 for a dense layer."""
    return 2 * shape.num_experts_per_tok * shape.hidden_size if shape.is_moe else 0


def _layer_activation_bytes(
    shape: ModelShape, *, tokens: int, element: int, tp: int, cp: int = 1, mode: str = "ulysses"
) -> int:
    """What autograd keeps of one decoder layer for a pass of `tokens` tokens on one rank (planning/memory.py's
    module docstring; the attention's by its kind, planning/attention_shapes.py); a CP rank keeps about as much
    per position for 1/cp of them, plus what its mode's attention keeps (planning/context_parallel_bytes.py).
    An MoE model's layers are all counted as MoE layers, its first dense layers too (DeepSeek-V3's three): k
    experts' widths and the dispatch keep more per token than the dense MLP (DeepSeek-V3: 4 x 8 x 2048 + 4 x 2048
    + 2 x 8 x 7168 elements against 4 x 18432), so the figure errs high."""
    h = shape.hidden_size
    per_token = (
        4 * h
        + shape.attention.saved_width(tp)
        + 4 * shape.active_intermediate // (1 if shape.is_moe else tp)  # TP leaves the experts whole
        + _dispatch_width(shape)
        + saved_width(shape, mode=mode, cp=cp, element=element)
    )
    return tokens_per_rank(tokens, cp) * (per_token * element + _float32_bytes_per_token(shape, tp=tp))


def _float32_bytes_per_token(shape: ModelShape, *, tp: int) -> int:
    """What a layer keeps in float32 whatever the compute dtype: each of its two RMSNorms computes in float32
    (Hugging Face's Llama, Qwen2 and Qwen3 norms) and keeps its input as float32 (h) and its reciprocal
    root mean square (1) for the backward, and the attention kernel keeps a log-sum-exp per head (TP's heads).
    Measured with saved-tensor hooks on a Qwen2 layer (h 256, 8 heads): these and the compute-dtype terms
    above are every byte autograd keeps of the layer, in float32 and in bfloat16 alike, but the rotary
    embedding's cos and sin, which all layers share (docs/scaling.md, section 12)."""
    return 4 * (2 * (shape.hidden_size + 1) + shape.num_heads // tp)


def micro_batch_tokens(cfg: JobConfig) -> int:
    """The most tokens one pass computes: micro_batch_size whole sequences, within micro_batch_tokens."""
    sequence = cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length
    tokens = cfg.training.micro_batch_size * sequence
    budget = cfg.training.micro_batch_tokens
    return tokens if budget is None else max(min(tokens, budget), sequence)


def update_micro_batches(cfg: JobConfig) -> int:
    """The micro-batches of a data-parallel rank's mini-batch (its share of the iteration's samples over
    algorithm.num_updates_per_iteration), each micro_batch_size rows, fewer where micro_batch_tokens
    holds fewer of the longest sequences (shorter ones pack into fewer passes at run time)."""
    training = cfg.training
    mini_batch = cfg.num_samples_per_iteration // training.data_parallel_size // cfg.algorithm.num_updates_per_iteration
    rows_per_pass = micro_batch_tokens(cfg) // (cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length)
    return -(-mini_batch // max(1, min(rows_per_pass, training.micro_batch_size)))


def decoder_activation_bytes(
    cfg: JobConfig, shape: ModelShape, *, element: int, tp: int, layers: int | None = None, held: int = 1
) -> int:
    """What `layers` decoder layers (default: all of them) keep for `held` micro-batches at once, with or
    without gradient checkpointing, on one rank (a CP rank: its 1/cp of the positions and a pass's whole
    4D mask, planning/context_parallel_bytes.py). Checkpointed, each held micro-batch keeps its layers'
    inputs, and one layer at a time is recomputed whole."""
    layers = shape.num_layers if layers is None else layers
    tokens, cp = micro_batch_tokens(cfg), cfg.training.context_parallel_size
    mode = cfg.training.context_parallel_mode
    per_layer = _layer_activation_bytes(shape, tokens=tokens, element=element, tp=tp, cp=cp, mode=mode)
    # A pass of one trimmed row has no padding and no mask (causal); otherwise at most a packed row's.
    masked = cfg.training.micro_batch_size > 1 or not cfg.training.trim_padding
    mask = mask_bytes(rows=1, sequence=tokens, cp=cp) if masked else 0
    if cfg.training.gradient_checkpointing:
        return held * (layers * tokens_per_rank(tokens, cp) * shape.hidden_size * element + mask) + per_layer
    return held * (layers * per_layer + mask)


def stage_activation_bytes(cfg: JobConfig, shape: ModelShape, stage: int) -> int:
    """The update's activations on pipeline stage `stage` (0 without PP): what autograd keeps there
    (`stage_saved_bytes`), the outputs a stage before the last keeps for its backward (`stage_output_bytes`),
    and the working set at the stage's fullest moment (`stage_working_bytes`)."""
    return (
        stage_saved_bytes(cfg, shape, stage)
        + stage_output_bytes(cfg, shape, stage)
        + stage_working_bytes(cfg, shape, stage)
    )


def stage_saved_bytes(cfg: JobConfig, shape: ModelShape, stage: int) -> int:
    """What autograd keeps on pipeline stage `stage` (0 without PP): its layers' for the micro-batches 1F1B
    holds there at once (planning/pipeline_stages.py), plus the final norm's on the last stage."""
    training = cfg.training
    stages = training.pipeline_parallel_size
    held = micro_batches_held(stage=stage, stages=stages, micro_batches=max(1, update_micro_batches(cfg)))
    layers = stage_layer_counts(shape.num_layers, stages)[stage]
    element, tp = compute_element_bytes(cfg), training.tensor_parallel_size
    decoder = decoder_activation_bytes(cfg, shape, element=element, tp=tp, layers=layers, held=held)
    return decoder + (final_norm_bytes(cfg, shape, element=element) if stage == stages - 1 else 0)


def stage_output_bytes(cfg: JobConfig, shape: ModelShape, stage: int) -> int:
    """The outputs stage `stage` keeps until their backward: a stage before the last runs each micro-batch's
    backward from its output and the gradient the next stage sends (training/pipeline.py), so it keeps the
    output (T x h in the compute dtype, a CP rank's positions), which autograd itself does not save, for every
    micro-batch it holds. None on the last stage, or without PP (there it is the final norm's input, counted
    in `final_norm_bytes`)."""
    stages = cfg.training.pipeline_parallel_size
    if stage == stages - 1:
        return 0
    held = micro_batches_held(stage=stage, stages=stages, micro_batches=max(1, update_micro_batches(cfg)))
    tokens = tokens_per_rank(micro_batch_tokens(cfg), cfg.training.context_parallel_size)
    return held * tokens * shape.hidden_size * compute_element_bytes(cfg)


def stage_working_bytes(cfg: JobConfig, shape: ModelShape, stage: int) -> int:
    """The transient bytes at stage `stage`'s fullest moment beside what it keeps: a layer's backward working set
    (`backward_working_bytes`), or on the last stage (the one stage without PP) the LM head's chunk
    (`head_chunk_bytes`) where that is larger. The head's backward is done before the layers' begins, so the
    two are never live together; a stage before the last peaks in its last layer's backward under the next
    micro-batch's activations (docs/scaling.md, section 12)."""
    element, tp = compute_element_bytes(cfg), cfg.training.tensor_parallel_size
    working = backward_working_bytes(cfg, shape, element=element, tp=tp)
    if stage == cfg.training.pipeline_parallel_size - 1:
        return max(head_chunk_bytes(cfg, shape), working)
    return working


def backward_working_bytes(cfg: JobConfig, shape: ModelShape, *, element: int, tp: int) -> int:
    """What a decoder layer's backward holds at its fullest beyond the activations autograd still keeps, for a
    pass of T tokens (a CP rank's positions): the gradient flowing down the residual stream (T x h in the
    compute dtype; under PP the one the next stage sent), beside the larger of the MLP's and, under ring
    attention, the attention's. The MLP's: the gradient of the down projection's input (T, I; `MmBackward0`)
    and the gradients of the activation and the up projection (2 x (T, I); `MulBackward0`'s outputs), while the
    down projection's input (T, I), which autograd kept, is already freed (a node's saved tensors go when it
    has run): 2 I a token (I a TP rank's slice). Its weight's gradient is the layer's whole gradient, counted
    by `fsdp_whole_gradient_bytes`. Ring attention's: a backward tile's two (H, t, t) score tiles
    (planning/context_parallel_bytes.py's `ring_block_bytes`). Measured at stage 0's peak under PP 2 and at a
    ring rank's peak (docs/scaling.md, sections 12 and 9). An MoE layer counts the k experts' widths a token
    runs, as its activations do (its experts' backwards run one at a time, so the figure errs high)."""
    training = cfg.training
    tokens, cp = micro_batch_tokens(cfg), training.context_parallel_size
    intermediate = shape.active_intermediate // (1 if shape.is_moe else tp)  # TP leaves the experts whole
    mlp = tokens_per_rank(tokens, cp) * 2 * intermediate * element
    ring = ring_block_bytes(shape, tokens=tokens, cp=cp, tp=tp, element=element)
    attention = ring if training.context_parallel_mode == "ring" else 0
    return tokens_per_rank(tokens, cp) * shape.hidden_size * element + max(mlp, attention)


def final_norm_bytes(cfg: JobConfig, shape: ModelShape, *, element: int) -> int:
    """What the final RMSNorm before the LM head keeps for a pass, as a layer's norms do
    (`_float32_bytes_per_token`): its float32 input and reciprocal root, its normalised product and weighted
    output in the compute dtype."""
    tokens = tokens_per_rank(micro_batch_tokens(cfg), cfg.training.context_parallel_size)
    return tokens * (4 * (shape.hidden_size + 1) + 2 * shape.hidden_size * element)


def activation_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """The update's activations (planning/memory.py's module docstring): one micro-batch's without PP;
    under PP the fullest stage's (stage 0's, which holds the most layers and micro-batches, unless the
    head's chunk on the last outweighs them)."""
    return max(stage_activation_bytes(cfg, shape, stage) for stage in range(cfg.training.pipeline_parallel_size))


def head_chunk_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """The LM head's working set: about three float32 (chunk, V) tensors, a chunk being the positions
    whose logits fit in LOGIT_CHUNK_BYTES, or the pass's tokens when fewer."""
    tokens = tokens_per_rank(micro_batch_tokens(cfg), cfg.training.context_parallel_size)  # a CP rank's positions
    chunk = min(tokens, max(1, LOGIT_CHUNK_BYTES // (4 * shape.vocab_size)))
    return 3 * chunk * shape.vocab_size * 4


def update_all_to_all_bytes(cfg: JobConfig, shape: ModelShape) -> int:
    """Bytes a CP rank sends the other ranks of its group in one update step: every micro-batch of
    its mini-batch a forward and a backward (and a recomputed forward with gradient checkpointing)
    of the longest sequences (planning/context_parallel_bytes.py), through its stage's layers under PP
    (the fullest stage's). 0 without CP."""
    training = cfg.training
    stage_layers = max(stage_layer_counts(shape.num_layers, training.pipeline_parallel_size))
    per_pass = context_bytes_per_pass(
        shape,
        mode=training.context_parallel_mode,
        tokens=micro_batch_tokens(cfg),
        cp=training.context_parallel_size,
        element=compute_element_bytes(cfg),
        recompute=training.gradient_checkpointing,
    )
    return update_micro_batches(cfg) * per_pass // shape.num_layers * stage_layers  # every layer sends alike
