"""Torch-side policy math: per-token logprobs (and entropy) of sampled responses under a causal LM.

These build the model inputs from the dock's columns exactly as docs/architecture.md fixes them,
so the actor (old logprobs, training), the reference and any test compute the same numbers:
`input_ids = cat(prompt_ids, response_ids)`, `attention_mask = cat(prompt_mask, response_mask)`,
`position_ids = cumsum(mask) - 1` clamped at 0, and response token t is scored by the logits at
position PL + t - 1.

A multi-turn trajectory (docs/agentic.md) also carries `response_attention_mask`: every token after
the prompt, the tools' included, is context the model attends to, while `response_mask` marks the
tokens it sampled, the only ones scored. Without that column the two are the same.

The LM head runs only where a token is scored: the model returns its last hidden states with no
logits, and `head_logprobs` applies the head to the scored positions a chunk at a time, so no pass
holds float32 logits of the whole (b, L, V), prompt included (docs/scaling.md, "Activations").

With `trim` and a model whose attention takes a 4D mask (`packing.packs_sequences`), a pass is one
packed sequence instead of padded rows: each prompt once, its responses after it, no padding
(engines/packing.py); the numbers are the row layout's up to float reassociation.

Under pipeline parallelism (models/pipeline_stage.py) every stage runs the same passes over the same rows,
each through its own layers; only the last stage has the head, so only it scores: the others' logprobs
are zeros, and the pass that reads the rows is the last stage's (training/context_parallel.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rldock.runtime.engines.head_logprobs import head_logprobs
from rldock.runtime.engines.packing import (
    attended_response_lengths,
    contiguous_responses,
    mask_kind,
    pack_pass,
    packed_runs,
    packing_pays,
    packs_sequences,
    pass_work,
)
from rldock.runtime.engines.ulysses import local_positions, pass_mask, shard_forward
from rldock.runtime.models.context_group import context_group, sum_over_group
from rldock.runtime.models.pass_cells import PassCells, PassListener
from rldock.runtime.models.pipeline_stage import pipeline_links
from rldock.runtime.models.routing_replay import packed_pass_cells, padded_pass_cells


@dataclass
class PassTally:
    """What a stage's policy passes computed, summed over its passes (`packing.pass_work`): tokens
    through the decoder layers, attended (query, key) pairs per layer, positions the LM head ran on.
    A worker returns `as_dict()` in its StageResult's metrics as `computed` (driver/utilisation.py reads it)."""

    tokens: int = 0
    pairs: int = 0
    head_positions: int = 0

    def as_dict(self, *, counts: bool = True) -> dict[str, int]:
        """`counts` False: zeros, for a rank whose passes repeat or continue another's (a TP peer, a pipeline
        stage before the last: the backend's `counts_passes`), so a stage's FLOPs count each pass once."""
        tally = self if counts else PassTally()
        return {"tokens": tally.tokens, "pairs": tally.pairs, "head_positions": tally.head_positions}


@dataclass(frozen=True)
class PolicyInputs:
    input_ids: Tensor  # (B, PL+SL) int64; a packed pass (1, N)
    attention_mask: Tensor  # (B, PL+SL) int64; a packed pass's (1, 1, N, N) mask (engines/packing.py)
    position_ids: Tensor  # (B, PL+SL) int64; a packed pass (1, N)


@dataclass(frozen=True)
class ResponseScores:
    logprobs: Tensor  # (B, SL) float32, 0 where response_mask is 0
    entropy: Tensor  # (B, SL) float32, 0 where response_mask is 0


def build_policy_inputs(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> PolicyInputs:
    """Concatenate left-padded prompts (B, PL) and right-padded responses (B, SL)."""
    input_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, PL+SL)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()  # (B, PL+SL)
    # Left pads get position 0 (clamped) and are masked out; real tokens count from 0 as they did
    # in vLLM, which saw the prompt without its pads.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # (B, PL+SL)
    return PolicyInputs(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


@dataclass(frozen=True)
class MicroBatch:
    """Which rows of a batch one forward pass takes, and the columns it keeps."""

    rows: Tensor  # (b,) int64 indices into the batch
    prompt_start: int  # first prompt column kept: the ones before are padding in every row
    response_end: int  # response columns kept, [0, response_end): the rest is padding in every row


def response_attention(batch) -> Tensor:
    """The response tokens a batch's model pass attends to (B, SL): `response_attention_mask` where
    the rollout wrote one (multi-turn: the tools' tokens too), else `response_mask`."""
    return batch["response_attention_mask"] if "response_attention_mask" in batch.keys() else batch["response_mask"]


def plan_micro_batches(
    prompt_mask: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    trim: bool,
    max_tokens: int | None = None,
    prompt_ids: Tensor | None = None,
) -> list[MicroBatch]:
    """Split a batch of left-padded prompts (B, PL) and right-padded responses (B, SL) into forward
    passes of at most `micro_batch_size` rows and, with `max_tokens`, of at most that many
    computed tokens (`micro_batch_rows`). With `prompt_ids` (packed passes) a pass keeps the
    columns up to its longest response and no prompt column range (a packed pass has no padding).

    With `trim`, rows are sorted by their token count (so a pass holds sequences of similar
    length) and each pass keeps only its own longest prompt and response: leading prompt columns
    that are padding in all its rows and trailing response columns past its longest response are
    not computed. Padding is masked out of attention and positions count real tokens only, so the
    kept columns give the same results. Without `trim`: consecutive rows, all PL + SL columns.
    """
    prompt_len = prompt_mask.shape[1]
    plans = []
    for rows in micro_batch_rows(
        prompt_mask,
        response_mask,
        micro_batch_size=micro_batch_size,
        trim=trim,
        max_tokens=max_tokens,
        prompt_ids=prompt_ids,
    ):
        if prompt_ids is not None:
            plans.append(MicroBatch(rows, 0, max(max(attended_response_lengths(response_mask[rows])), 1)))
            continue
        if not trim:
            plans.append(MicroBatch(rows, 0, response_mask.shape[1]))
            continue
        prompt_columns = prompt_mask[rows].any(dim=0).nonzero()  # (k, 1)
        response_columns = response_mask[rows].any(dim=0).nonzero()  # (k, 1)
        # Column PL - 1 always stays: its logits score response token 0.
        prompt_start = min(int(prompt_columns[0]) if len(prompt_columns) else prompt_len, prompt_len - 1)
        response_end = max(int(response_columns[-1]) + 1 if len(response_columns) else 0, 1)
        plans.append(MicroBatch(rows, prompt_start, response_end))
    return plans


def micro_batch_rows(
    prompt_mask: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    trim: bool,
    max_tokens: int | None = None,
    prompt_ids: Tensor | None = None,
) -> list[Tensor]:
    """The rows (b,) of each pass over a batch of left-padded prompts (B, PL) and right-padded
    responses (B, SL): consecutive runs of `micro_batch_size` rows, or with `trim` the rows sorted
    by token count, shortest first, and cut into runs of at most `micro_batch_size` rows.

    `max_tokens` (with `trim`): a run also ends before its computed tokens, rows x (its longest
    prompt + its longest response), would pass `max_tokens`; a row longer than that runs alone.
    Short rows then share a pass by the dozen and long ones go few at a time, so a batch of mixed
    lengths costs about its real token count instead of `micro_batch_size` x its longest row.

    `prompt_ids` (B, PL), for packed passes (`packing_prompts`): rows that share a prompt run
    together and a run's tokens count each prompt once and no padding (`packing.packed_runs`).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if prompt_ids is not None:
        return packed_runs(
            prompt_ids, prompt_mask, response_mask, micro_batch_size=micro_batch_size, max_tokens=max_tokens
        )
    num_rows = prompt_mask.shape[0]
    if not trim:
        return [
            torch.arange(start, min(start + micro_batch_size, num_rows))
            for start in range(0, num_rows, micro_batch_size)
        ]
    order = sort_by_tokens({"prompt_mask": prompt_mask, "response_mask": response_mask})  # (B,)
    if max_tokens is None:
        return list(order.split(micro_batch_size))
    prompt_lengths = prompt_mask.sum(dim=1).tolist()  # left-padded: the real tokens are the last ones
    response_columns = response_mask * torch.arange(1, response_mask.shape[1] + 1)  # (B, SL)
    response_lengths = response_columns.amax(dim=1).tolist()  # right-padded: one past the last real token
    runs: list[list[int]] = []
    longest_prompt = longest_response = 0
    for row in order.tolist():
        prompt, response = max(longest_prompt, prompt_lengths[row]), max(longest_response, response_lengths[row])
        if runs and len(runs[-1]) < micro_batch_size and (len(runs[-1]) + 1) * (prompt + response) <= max_tokens:
            runs[-1].append(row)
            longest_prompt, longest_response = prompt, response
        else:
            runs.append([row])
            longest_prompt, longest_response = prompt_lengths[row], response_lengths[row]
    return [torch.tensor(run, dtype=torch.int64) for run in runs]


def packing_prompts(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    attention: Tensor,
    *,
    trim: bool,
    micro_batch_size: int,
    max_tokens: int | None = None,
) -> Tensor | None:
    """The prompts (B, PL) to pack a batch's passes by, or None for passes of padded rows: packing
    needs `trim` (no padding computed), a model whose attention takes a 4D mask
    (`packing.packs_sequences`), every row's attended response tokens (B, SL) a run from column 0,
    and passes of `micro_batch_size` rows (within `max_tokens`) that cost fewer FLOPs packed
    (`packing.packing_pays`)."""
    if not (trim and packs_sequences(model) and contiguous_responses(attention)):
        return None
    pays = packing_pays(
        model, prompt_ids, prompt_mask, attention, micro_batch_size=micro_batch_size, max_tokens=max_tokens
    )
    return prompt_ids if pays else None


def sort_by_tokens(batch) -> Tensor:
    """Row order (B,) of a batch with `prompt_mask` and `response_mask` columns, shortest first."""
    return torch.argsort(batch["prompt_mask"].sum(dim=1) + batch["response_mask"].sum(dim=1), stable=True)


def scatter_rows(chunks: list[Tensor], plans: list[MicroBatch], response_len: int) -> Tensor:
    """Per-pass results (b, response_end) back into the batch's row order and fixed (B, SL) shape,
    zero in the trimmed columns; differentiable."""
    padded = torch.cat([nn.functional.pad(chunk, (0, response_len - chunk.shape[1])) for chunk in chunks])
    rows = torch.cat([plan.rows for plan in plans])  # (B,)
    return padded[torch.argsort(rows)]  # (B, SL)


def micro_batch_inputs(
    plan: MicroBatch, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> tuple[PolicyInputs, slice]:
    """The model inputs of one pass and the slice of its output positions that score (predict)
    its response tokens 0 .. response_end - 1."""
    rows, start, end = plan.rows, plan.prompt_start, plan.response_end
    inputs = build_policy_inputs(
        prompt_ids[rows, start:], prompt_mask[rows, start:], response_ids[rows, :end], response_mask[rows, :end]
    )
    kept_prompt = prompt_ids.shape[1] - start
    # Position kept_prompt + t - 1 predicts response token t.
    return inputs, slice(kept_prompt - 1, kept_prompt + end - 1)


def output_head(model: nn.Module) -> nn.Linear:
    """The LM head (V, H) of a causal LM, through the DDP wrapper the update trains with (FSDP and
    TP leave the head a plain linear on every rank; a LoRA policy keeps the base model's head)."""
    module: Any = model.module if isinstance(model, DistributedDataParallel) else model  # a Hugging Face model
    head = module.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(f"{type(module).__name__}: the output embeddings are {type(head).__name__}, not a linear head")
    return head


def _scored_hidden(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    attention: Tensor,
    plans: list[MicroBatch],
    *,
    packed: bool,
    routes: PassListener | None = None,
) -> Iterator[tuple[Tensor, MicroBatch, Tensor | None]]:
    """Yield the last hidden states (b, response_end, H) that score each kept response token, per pass:
    `packed`, from one packed sequence per pass (engines/packing.py), else from its padded rows.

    The model runs through its own forward (the training wrapper's hooks included) with no logits
    at all (`logits_to_keep` an empty index); `head_logprobs` applies the head where a token is scored.

    Under context parallelism (engines/ulysses.py) the model computes this rank's slice of the
    sequence only: the third item (b, response_end) marks the states this rank holds (the others are
    another rank's and read as a placeholder); None without CP.

    `routes` (MoE routing replay and the router loss's record, models/routing_replay.py) learns before
    each pass where its tokens sit in the batch's (B, PL + SL) token grid (under CP: this rank's tokens).
    """
    no_logits = torch.empty(0, dtype=torch.int64, device=prompt_ids.device)
    group = context_group(model)
    row_width = prompt_ids.shape[1] + response_ids.shape[1]  # the token grid's PL + SL
    stage = pipeline_links(model)
    dtype = output_head(model).weight.dtype if stage is None else stage.dtype  # a stage may have no head

    def last_hidden(input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor) -> Tensor:
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=no_logits,
        )
        return outputs.hidden_states[-1]  # the final norm's output (rows, N, H)

    for plan in plans:
        # (rows, positions), broadcast to (b, response_end): where each scored state sits in the model's (rows, N, H)
        if packed:
            rows = plan.rows
            pass_ = pack_pass(
                prompt_ids[rows],
                prompt_mask[rows],
                response_ids[rows],
                attention[rows],
                response_end=plan.response_end,
                mask_kind=mask_kind(model),
                dtype=dtype,
            )
            inputs = PolicyInputs(pass_.input_ids, pass_.attention_mask, pass_.position_ids)
            pick_rows, positions = (
                torch.zeros((), dtype=torch.int64, device=prompt_ids.device),
                pass_.predictors,
            )  # the one packed row
            local_cells = PassCells(pass_.cells, pass_.cell_tokens)
            cells = None if routes is None else packed_pass_cells(plan.rows, local_cells, row_width=row_width)
        else:
            inputs, scored = micro_batch_inputs(plan, prompt_ids, prompt_mask, response_ids, attention)
            pick_rows = torch.arange(len(plan.rows), device=prompt_ids.device)[:, None]  # (b, 1)
            positions = torch.arange(scored.start, scored.stop, device=prompt_ids.device)[None]  # (1, end)
            cells = (
                None
                if routes is None
                else padded_pass_cells(
                    plan.rows, prompt_start=plan.prompt_start, attention_mask=inputs.attention_mask, row_width=row_width
                )
            )
        if routes is not None and cells is not None:
            if group is not None:  # the router sees this rank's positions only (models/routing_replay.py)
                _, local = local_positions(inputs.input_ids.shape[1], group)
                cells = cells.on_positions(width=inputs.input_ids.shape[1], local=local)
            routes.begin_pass(cells)
        if group is None:
            hidden = last_hidden(inputs.input_ids, inputs.attention_mask, inputs.position_ids)
            yield hidden[pick_rows, positions], plan, None
            continue
        mask = pass_mask(inputs.attention_mask, kind=mask_kind(model), dtype=dtype)
        hidden, local = shard_forward(
            last_hidden, inputs.input_ids, mask, inputs.position_ids, group=group, kind=mask_kind(model)
        )  # (rows, n, H) of this rank's positions
        owned = (positions >= local.start) & (positions < local.stop)  # broadcast below
        on_rank = (positions - local.start).clamp(0, hidden.shape[1] - 1)
        picked = hidden[pick_rows, on_rank]  # (b, end, H)
        yield picked, plan, owned.expand(picked.shape[:2])


def _score_passes(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    attention_mask: Tensor | None,
    *,
    micro_batch_size: int,
    max_tokens: int | None,
    temperature: float,
    trim: bool,
    with_entropy: bool,
    tally: PassTally | None = None,
    routes: PassListener | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs (B, SL) and, `with_entropy`, entropy (B, SL) of the response tokens where
    `response_mask` is 1 (0 elsewhere): the head runs on those positions only. `tally` adds up
    what the passes computed."""
    attention = response_mask if attention_mask is None else attention_mask
    packing = packing_prompts(
        model,
        prompt_ids,
        prompt_mask,
        attention,
        trim=trim,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
    )
    plans = plan_micro_batches(
        prompt_mask,
        attention,
        micro_batch_size=micro_batch_size,
        trim=trim,
        max_tokens=max_tokens,
        prompt_ids=packing,
    )
    stage = pipeline_links(model)
    scores = stage is None or stage.last  # a stage before the last passes its states on (module docstring)
    head = output_head(model) if scores else None
    group = context_group(model)
    cp = 1 if group is None else torch.distributed.get_world_size(group)
    logprob_chunks, entropy_chunks = [], []
    for hidden, plan, owned in _scored_hidden(
        model, prompt_ids, prompt_mask, response_ids, attention, plans, packed=packing is not None, routes=routes
    ):
        end = plan.response_end
        if head is None:
            logprob_chunks.append(hidden.new_zeros((len(plan.rows), end), dtype=torch.float32))
            entropy_chunks.append(logprob_chunks[-1])
            continue
        scored = response_mask[plan.rows, :end].bool()  # (b, end)
        here = scored if owned is None else scored & owned  # the scored states this rank computed
        if tally is not None:
            rows = plan.rows
            tokens, pairs = pass_work(prompt_ids[rows], prompt_mask[rows], attention[rows], packed=packing is not None)
            # A CP rank computes 1/cp of the tokens and, for its heads, 1/cp of the attention.
            tally.tokens, tally.pairs = tally.tokens + -(-tokens // cp), tally.pairs + -(-pairs // cp)
            tally.head_positions += int(here.sum())
        logprobs, entropy = head_logprobs(
            hidden[here],  # (n, H)
            head.weight,
            head.bias,
            response_ids[plan.rows, :end][here],
            temperature=temperature,
            with_entropy=with_entropy,
        )
        # Back to (b, end), 0 where nothing is scored; index_put keeps the logprobs' gradient. Under
        # CP each rank scored the states it holds, and the sum gives every rank all of them.
        chunks = [logprobs.new_zeros(here.shape).index_put((here,), logprobs)]
        if entropy is not None:
            chunks.append(entropy.new_zeros(here.shape).index_put((here,), entropy))
        if group is not None:
            chunks = [sum_over_group(chunk, group) for chunk in chunks]
        logprob_chunks.append(chunks[0])
        if entropy is not None:
            entropy_chunks.append(chunks[1])
    response_len = response_ids.shape[1]
    return (
        scatter_rows(logprob_chunks, plans, response_len),
        scatter_rows(entropy_chunks, plans, response_len) if with_entropy else None,
    )


def response_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    trim: bool = False,
    attention_mask: Tensor | None = None,
    tally: PassTally | None = None,
    routes: PassListener | None = None,
) -> Tensor:
    """Log-probability (B, SL) of each response token under `model`; 0 where the mask is 0.
    `attention_mask` (B, SL): the response tokens attended to, when more than the scored ones
    (`response_attention`); None: `response_mask`.

    Runs `micro_batch_size` rows per forward pass, at most `max_tokens` tokens with `trim` (each
    pass on its own longest sequence, see `plan_micro_batches`). Gradients flow when called outside
    `torch.no_grad()`, so the same function serves old logprobs, reference logprobs and the loss.
    `routes`: MoE routing to record or replay (models/routing_replay.py).
    """
    logprobs, _ = _score_passes(
        model,
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        attention_mask,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        temperature=temperature,
        trim=trim,
        with_entropy=False,
        tally=tally,
        routes=routes,
    )
    return logprobs


def response_logprobs_and_entropy(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int | None = None,
    temperature: float = 1.0,
    trim: bool = False,
    attention_mask: Tensor | None = None,
    tally: PassTally | None = None,
    routes: PassListener | None = None,
) -> ResponseScores:
    """`response_logprobs` plus the policy's entropy (B, SL) at each scored response position, from
    the same forward pass. Gradients flow into the logprobs only: the entropy is a metric here (no
    entropy bonus)."""
    logprobs, entropy = _score_passes(
        model,
        prompt_ids,
        prompt_mask,
        response_ids,
        response_mask,
        attention_mask,
        micro_batch_size=micro_batch_size,
        max_tokens=max_tokens,
        temperature=temperature,
        trim=trim,
        with_entropy=True,
        tally=tally,
        routes=routes,
    )
    assert entropy is not None
    return ResponseScores(logprobs=logprobs, entropy=entropy)
