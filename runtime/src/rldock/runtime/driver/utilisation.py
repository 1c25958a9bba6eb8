"""How close each stage of an iteration runs to the hardware: model FLOPs per stage from the model's
shape and the tokens the stage computed, over its compute seconds, against a device's peak
(`mfu/<stage>`), and the rollout's decode bytes against the memory bandwidth (`mbu/rollout`).

Pure functions of numbers: the driver records them per iteration (metrics.iteration_record), from
the stages' results and the device's rates (`rldock bench peak`, runtime/peak.py, or the config's
resources.peak_tflops / memory_bandwidth_gbps).

The count is the usual one for a Llama/Qwen-style decoder (no bias, norm or softmax terms):
- a forward pass costs 2 FLOPs per weight of the decoder layers per token computed, 4 x heads x
  head_dim per layer per attended (query, key) pair (q.k and the weighted sum of v), and 2 x hidden
  x vocab per position the LM head runs on (the policy's passes run it on scored tokens only);
- the rollout: each prompt group's prompt is counted prefilled once and the LM head once per
  response, the model-FLOPs convention (the work the model needs, not what an engine spends: vLLM's
  prefix cache reuses only full computed blocks, so a group's N requests may each recompute part
  of the prompt); each decode step feeds one sampled token (R - 1 steps for an R-token response)
  and runs the head on it. A multi-turn rollout's later prefills (each turn's tool output) and
  partial rollout's second round are counted as decode steps, and DAPO's dynamic sampling counts
  the prompts of the groups it kept, not of those it drew again (its responses and compute seconds
  span every round): lower bounds;
- an update: 3x the forward (forward, then gradients of inputs and of weights), the LM head 4x
  (its chunked backward recomputes the logits, engines/head_logprobs.py) and the decoder layers 4x
  under training.gradient_checkpointing (the backward recomputes their forward). Frozen weights
  (freeze_embeddings, LoRA) are counted as trained, as MFU conventionally does;
- an inference stage (old logprobs, the reference, the critic's values): 1x the forward;
- the critic's passes run the decoder layers and a value head of one output per position, which
  the count leaves out (no LM head), its update 3x the forward.
The update's and the inference stages' token counts are what their passes computed, packed
(each prompt once per pass) or in rows (each row's prompt), padding left out: the workers count
them (engines/policy.PassTally); a TP peer, which runs its leader's batches, reports none.

Each stage is held to the peak of the dtype it computes in (UtilisationInputs.stage_dtype): the
rollout the engine's, the training backends' passes training.mixed_precision's else model.dtype, the
reference model.dtype.

The denominator is the stage's compute seconds (`timing/compute/<stage>`, the slowest rank's time
in the model, without the dock's) times the devices it ran on times one device's peak. On a CPU
every rank shares the one CPU, so a stage's devices are 1 and the peak is the whole CPU's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from rldock.config import JobConfig
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.flow.states import CRITIC_UPDATE, PREFERENCE_UPDATE, REFERENCE_INFERENCE, ROLLOUT, UPDATE
from rldock.runtime.planning.memory import DTYPE_BYTES, compute_dtypes
from rldock.runtime.planning.shapes import ModelShape, layer_flops, shape_from_hf_config

logger = logging.getLogger(__name__)

UPDATE_STATES = (UPDATE.name, PREFERENCE_UPDATE.name, CRITIC_UPDATE.name)


def forward_flops(shape: ModelShape, *, tokens: float, pairs: float, head_positions: float) -> float:
    """FLOPs of forward passes that computed `tokens` tokens through the decoder layers, attended
    `pairs` (query, key) pairs in each layer and ran the LM head on `head_positions` positions:
    2 x layer weights per token and 4 x heads x head_dim per pair, per layer, plus 2 x hidden x vocab
    per head position.

    >>> shape = ModelShape("toy", vocab_size=10, hidden_size=4, num_layers=2, num_heads=2, num_kv_heads=1,
    ...                    head_dim=2, intermediate_size=8, tie_word_embeddings=True)
    >>> forward_flops(shape, tokens=3, pairs=6, head_positions=1)  # 2*(2*(48+96)*3 + 16*6) + 80
    2000.0
    """
    per_token, per_pair = layer_flops(
        shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.active_intermediate
    )
    head = 2.0 * shape.hidden_size * shape.vocab_size
    return shape.num_layers * (per_token * tokens + per_pair * pairs) + head * head_positions


@dataclass(frozen=True)
class RolloutWork:
    """What a rollout computed: prefill and decode token counts and attended pairs, head positions."""

    prefill_tokens: float
    prefill_pairs: float
    decode_tokens: float
    decode_pairs: float
    head_positions: float


def rollout_work(prompt_lengths: Sequence[int], response_lengths: Sequence[int], *, group_size: int) -> RolloutWork:
    """The rollout's counts (module docstring) from each group's prompt length and every response's
    length; a response's prompt is taken at the mean prompt length (the results do not pair them)."""
    prompt = sum(prompt_lengths) / len(prompt_lengths)
    steps = [max(r - 1, 0) for r in response_lengths]  # the last sampled token is never fed back
    return RolloutWork(
        prefill_tokens=float(sum(prompt_lengths)),
        prefill_pairs=sum(p * (p + 1) / 2 for p in prompt_lengths),
        decode_tokens=float(sum(steps)),
        # step j (0-based) feeds response token j at position P + j: it attends P + j + 1 keys
        decode_pairs=sum(s * prompt + s * (s + 1) / 2 for s in steps),
        head_positions=float(len(prompt_lengths) * group_size + sum(steps)),
    )


def rollout_flops(shape: ModelShape, work: RolloutWork) -> float:
    """Prefill plus decode: 2 x params x tokens plus the attention term (`forward_flops`)."""
    return forward_flops(
        shape,
        tokens=work.prefill_tokens + work.decode_tokens,
        pairs=work.prefill_pairs + work.decode_pairs,
        head_positions=work.head_positions,
    )


def decode_bytes(shape: ModelShape, work: RolloutWork, *, decode_steps: int, bytes_per_param: int) -> float:
    """Bytes the decode reads: every weight once per engine step (`decode_steps`, the batch's
    longest response - 1 when an engine decodes its responses together) and each attended key's K
    and V once per decode token."""
    weights = decode_steps * shape.num_params * bytes_per_param
    return weights + work.decode_pairs * shape.kv_bytes_per_token(bytes_per_param)


def update_flops(shape: ModelShape, *, tokens: float, pairs: float, head_positions: float, recompute: bool) -> float:
    """An update's FLOPs (module docstring): 3x the forward, the LM head once more (its backward
    recomputes the logits) and, with `recompute` (gradient checkpointing), the layers' forward again."""
    layers = forward_flops(shape, tokens=tokens, pairs=pairs, head_positions=0)
    head = forward_flops(shape, tokens=0, pairs=0, head_positions=head_positions)
    return (3 + recompute) * layers + 4 * head


@dataclass(frozen=True)
class DeviceRates:
    """One device's peak FLOP/s in each dtype the job's stages compute in and its memory bandwidth
    (bytes/s); `shared`: every rank runs on the same device (a CPU), so a stage's devices are 1."""

    peak_flops: Mapping[str, float]  # by dtype name (model.dtype's names)
    bandwidth: float
    shared: bool


def job_rates(
    *,
    peak_tflops: float | None,
    bandwidth_gbps: float | None,
    dtypes: Sequence[str],
    measured: Mapping[str, Mapping[str, Any]],
    device_kind: str,
) -> DeviceRates:
    """The job's device rates in `dtypes`: resources.peak_tflops (for every dtype) and
    memory_bandwidth_gbps where set, else the `measured` ones (runtime/peak.py's records by dtype;
    the bandwidth from any of them, a copy's rate being the same in every dtype)."""
    peaks = {
        dtype: peak_tflops * 1e12 if peak_tflops is not None else measured[dtype]["peak_flops"] for dtype in dtypes
    }
    return DeviceRates(
        peak_flops=peaks,
        bandwidth=bandwidth_gbps * 1e9 if bandwidth_gbps is not None else next(iter(measured.values()))["bandwidth"],
        shared=device_kind == "cpu",
    )


@dataclass(frozen=True)
class UtilisationInputs:
    """What the driver knows for a run's `mfu/<stage>` besides the iteration's results."""

    shape: ModelShape
    rates: DeviceRates
    group_size: int
    recompute: bool  # training.gradient_checkpointing
    generation_tp: int  # devices per rollout engine
    rollout_dtype: str  # the engine's (planning.memory.engine_dtype): its peak, its weights' and KV cache's bytes
    training_dtype: str  # what the training backends' passes compute in (planning.memory.training_dtype)
    reference_dtype: str  # model.dtype

    def stage_dtype(self, state: str) -> str:
        """The dtype `state`'s passes compute in, whose peak is its `mfu/` denominator."""
        if state == ROLLOUT.name:
            return self.rollout_dtype
        return self.reference_dtype if state == REFERENCE_INFERENCE.name else self.training_dtype


def stage_utilisation(
    results: Mapping[str, Sequence[StageResult]],
    inputs: UtilisationInputs,
    *,
    prompt_lengths: Sequence[int],
    response_lengths: Sequence[int],
) -> dict[str, float]:
    """`flops/<stage>` (the stage's model FLOPs over all its ranks), `mfu/<stage>` and the rollout's
    `mbu/rollout` of one iteration, from each state's rank results (their `compute_s`, the passes'
    `computed` counts and the rollout's `decode_steps`) and the samples' facts the driver read
    (`prompt_lengths` per group, `response_lengths` per sample)."""
    shape, rates = inputs.shape, inputs.rates
    flops: dict[str, float] = {}
    devices: dict[str, int] = {}
    metrics: dict[str, float] = {}
    rollouts = results.get(ROLLOUT.name, [])
    if rollouts and response_lengths:
        work = rollout_work(prompt_lengths, response_lengths, group_size=inputs.group_size)
        flops[ROLLOUT.name] = rollout_flops(shape, work)
        devices[ROLLOUT.name] = len(rollouts) * inputs.generation_tp
        steps = sum(r.metrics["decode_steps"] for r in rollouts)
        seconds = max(r.compute_s for r in rollouts)
        used = 1 if rates.shared else devices[ROLLOUT.name]
        if seconds > 0:
            metrics["mbu/rollout"] = (
                decode_bytes(shape, work, decode_steps=steps, bytes_per_param=DTYPE_BYTES[inputs.rollout_dtype])
                / seconds
                / (rates.bandwidth * used)
            )
    for state, ranks in results.items():
        counted = [r.metrics["computed"] for r in ranks if "computed" in r.metrics]
        if not counted:
            continue
        tokens, pairs, heads = (sum(c[key] for c in counted) for key in ("tokens", "pairs", "head_positions"))
        if state in UPDATE_STATES:
            flops[state] = update_flops(
                shape, tokens=tokens, pairs=pairs, head_positions=heads, recompute=inputs.recompute
            )
        else:
            flops[state] = forward_flops(shape, tokens=tokens, pairs=pairs, head_positions=heads)
        devices[state] = len(ranks)
    for state, total in flops.items():
        seconds = max(r.compute_s for r in results[state])
        metrics[f"flops/{state}"] = total
        if seconds > 0:
            used = 1 if rates.shared else devices[state]
            metrics[f"mfu/{state}"] = total / seconds / (rates.peak_flops[inputs.stage_dtype(state)] * used)
    return dict(sorted(metrics.items()))


def measure_utilisation_inputs(cfg: JobConfig, reference_dir: Path, actor) -> UtilisationInputs | None:
    """The model's shape and the device's rates for the `mfu/` metrics (runtime/driver/utilisation.py):
    the rates the config sets, else those `actor` (actor rank 0's Ray actor) measures on its device in each dtype the
    stages compute in (`rldock bench peak`'s cache, or a measurement of a few seconds now).
    None, with a warning, where the count cannot be made (a config.json without the fields it
    reads, a device whose peak cannot be measured): a metric never stops the job."""
    resources = cfg.resources
    config_file = reference_dir / "config.json"
    try:
        shape = shape_from_hf_config(json.loads(config_file.read_text()), name=cfg.model.path)
    except KeyError as missing:
        logger.warning(
            "no mfu/ metrics: %s has no %s, which the FLOP count reads (Llama/Qwen-style field names)",
            config_file,
            missing,
        )
        return None
    rollout, training, reference = compute_dtypes(cfg)
    dtypes = sorted({rollout, training, reference})
    if resources.peak_tflops is None:
        measuring = dtypes
    else:  # the bandwidth only: one measurement
        measuring = [rollout] if resources.memory_bandwidth_gbps is None else []
    found = ray.get(actor.device_rates.remote(measuring))
    if "unavailable" in found:
        logger.warning(
            "no mfu/ metrics: the device's peak could not be measured (%s); set resources.peak_tflops "
            "and resources.memory_bandwidth_gbps to have them",
            found["unavailable"],
        )
        return None
    return UtilisationInputs(
        shape=shape,
        rates=job_rates(
            peak_tflops=resources.peak_tflops,
            bandwidth_gbps=resources.memory_bandwidth_gbps,
            dtypes=dtypes,
            measured=found["measured"],
            device_kind=found["device_kind"],
        ),
        group_size=cfg.algorithm.num_responses_per_prompt,
        recompute=cfg.training.gradient_checkpointing,
        generation_tp=cfg.rollout.tensor_parallel_size,
        rollout_dtype=rollout,
        training_dtype=training,
        reference_dtype=reference,
    )
