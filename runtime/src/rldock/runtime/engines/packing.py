"""Packed passes: the rows of a forward pass laid end to end in one sequence, each prompt once.

A GRPO batch holds G responses to each prompt, and the row layout (engines/policy.py) runs each
prompt G times, padded to the pass's longest row. Packed, a pass is one sequence (1, N): each
distinct prompt's real tokens, then the attended tokens of every response to it, with no padding.
A 4D attention mask lets each response attend to its own prompt and its own earlier tokens only,
and positions restart per response where they were in its row (prompt 0 .. P - 1, response P ..),
so every token sees exactly what it sees in its row: the numbers are the row layout's up to float
reassociation. Response token t is scored by the hidden state of the token before it in its row:
token t - 1, or for t = 0 the prompt's last token, which the group's responses share.

The saving is the group's repeated prompts and the padding: in the tool example (prompt ~275,
answers ~85, G 4) a group's pass computes 615 tokens instead of 4 x 360 (docs/results.md, "The
update's cost"). Prompt sharing among rows of a pass is the idea of Prefix Grouper
(arXiv 2506.05433); sequence packing with restarting positions is what TRL and verl call padding-free.

Packing needs a model whose attention takes a custom 4D mask: Hugging Face's `sdpa` (a boolean
mask) and `eager` (an additive one) do, with no sliding window (the mask here has none).
`flash_attention_2` or a sliding-window model keep the row layout.

It pays where the tokens it saves outweigh the attention it adds: a dense masked kernel computes
every (query, key) pair of the packed sequence, N^2, against b x L^2 for b padded rows, so long
responses from one prompt (N = P + G x R) can cost more packed than in rows. `packing_pays`
estimates both with the usual FLOP count of a decoder layer and packs only when packed is cheaper:
the tool example's passes estimate 0.46x of the rows' FLOPs (measured 0.43x of the CPU time), a
7B model with G 8 answers of 8k tokens to a 2k prompt would not pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from rldock.runtime.engines.context_attention import MASK_KINDS as CONTEXT_MASK_KINDS
from rldock.runtime.planning.shapes import layer_flops

# Attention implementations that take a ready 4D mask as is (transformers' masking_utils returns a
# 4D mask untouched), and the mask each one reads.
# Context parallelism's (engines/context_attention.py, Ulysses and ring) take the mask of the one they wrap.
_MASK_KINDS = {"sdpa": "boolean", "eager": "additive", **CONTEXT_MASK_KINDS}


def hf_config(model: nn.Module) -> Any:
    """The Hugging Face config of a causal LM, through the DDP wrapper (a PEFT model forwards it)."""
    module = model.module if isinstance(model, DistributedDataParallel) else model
    return module.config


def packs_sequences(model: nn.Module) -> bool:
    """Whether `model`'s attention takes a packed pass's 4D mask (module docstring): sdpa or eager,
    and no sliding-window layer."""
    config = hf_config(model)
    if getattr(config, "_attn_implementation", None) not in _MASK_KINDS:
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or getattr(config, "use_sliding_window", True) is False


def _layer_flops(config: Any) -> tuple[float, float] | None:
    """FLOPs of one decoder layer's forward per token (its linear layers) and per attended
    (query, key) pair (scores and weighted values), from a Llama/Qwen-style config; None when the
    config does not name the sizes."""
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    mlp = getattr(config, "intermediate_size", None)
    if getattr(config, "num_experts_per_tok", None) and getattr(config, "moe_intermediate_size", None):
        mlp = config.num_experts_per_tok * config.moe_intermediate_size  # MoE: the k experts a token runs
    if not (hidden and heads and mlp):
        return None
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return layer_flops(hidden, heads, kv_heads, head_dim, mlp)


def packing_pays(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    attention: Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int | None,
) -> bool:
    """Whether the batch's packed passes (`packed_runs`) cost fewer FLOPs than its rows would,
    each row counted at its real length (the rows' padding left out, so a tie keeps the rows)."""
    flops = _layer_flops(hf_config(model))
    if flops is None:
        return False
    per_token, per_pair = flops
    lengths = (prompt_mask.sum(dim=1) + attention.sum(dim=1)).tolist()  # (B,) real tokens per row
    rows = sum(per_token * n + per_pair * n * n for n in lengths)
    packed = 0.0
    for run in packed_runs(
        prompt_ids, prompt_mask, attention, micro_batch_size=micro_batch_size, max_tokens=max_tokens
    ):
        n = packed_length(prompt_ids[run], prompt_mask[run], attention[run])
        packed += per_token * n + per_pair * n * n
    return packed < rows


def packed_length(prompt_ids: Tensor, prompt_mask: Tensor, attention: Tensor) -> int:
    """Tokens of one packed pass over these rows (B, PL) / (B, SL): each distinct prompt once plus
    every response's attended tokens."""
    groups = prompt_groups(prompt_ids, prompt_mask).tolist()
    first_rows = {group: row for row, group in reversed(list(enumerate(groups)))}
    prompt_lengths = prompt_mask.sum(dim=1)
    return sum(int(prompt_lengths[row]) for row in first_rows.values()) + int(attention.sum())


def pass_work(prompt_ids: Tensor, prompt_mask: Tensor, attention: Tensor, *, packed: bool) -> tuple[int, int]:
    """Tokens one pass over these rows (B, PL) / (B, SL) computes and the (query, key) pairs they
    attend, padding left out (driver/utilisation.py counts FLOPs from them): packed, each distinct prompt
    once (P (P + 1) / 2 pairs) and each response of r tokens after it (r P + r (r + 1) / 2); in rows,
    each row's n = P + r tokens (n (n + 1) / 2 pairs)."""
    prompt_lengths = prompt_mask.sum(dim=1).tolist()
    response_lengths = attention.sum(dim=1).tolist()
    if not packed:
        rows = [p + r for p, r in zip(prompt_lengths, response_lengths)]
        return sum(rows), sum(n * (n + 1) // 2 for n in rows)
    groups = prompt_groups(prompt_ids, prompt_mask).tolist()
    prompts = {group: prompt_lengths[row] for row, group in enumerate(groups)}
    pairs = sum(p * (p + 1) // 2 for p in prompts.values())
    pairs += sum(r * p + r * (r + 1) // 2 for p, r in zip(prompt_lengths, response_lengths))
    return packed_length(prompt_ids, prompt_mask, attention), pairs


def prompt_groups(prompt_ids: Tensor, prompt_mask: Tensor) -> Tensor:
    """Group ids (B,) of left-padded prompts (B, PL): rows with the same prompt (tokens and
    padding) share an id; ids count from 0 in order of first appearance."""
    keys = prompt_ids.masked_fill(prompt_mask == 0, -1)  # pads equal whatever id they hold
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)  # (B,) ids in sorted order
    first_row: dict[int, int] = {}
    for row, key in enumerate(inverse.tolist()):
        first_row.setdefault(key, row)
    order = {key: rank for rank, key in enumerate(sorted(first_row, key=first_row.__getitem__))}
    return torch.tensor([order[key] for key in inverse.tolist()], dtype=torch.int64)


def attended_response_lengths(attention: Tensor) -> list[int]:
    """Attended response tokens per row of a right-padded (B, SL) attention mask: one past the
    last attended column."""
    columns = attention * torch.arange(1, attention.shape[1] + 1, device=attention.device)  # (B, SL)
    return columns.amax(dim=1).tolist()


def contiguous_responses(attention: Tensor) -> bool:
    """Whether every row's attended response tokens (B, SL) are a run from column 0: a packed pass
    drops what is not attended, so a hole would change which state scores the token after it."""
    lengths = torch.tensor(attended_response_lengths(attention), device=attention.device)  # (B,)
    return bool((attention.sum(dim=1) == lengths).all())


def packed_runs(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    attention: Tensor,
    *,
    micro_batch_size: int,
    max_tokens: int | None,
) -> list[Tensor]:
    """Rows (b,) of each packed pass over a batch, rows that share a prompt next to each other and
    groups in order of first appearance.

    Without `max_tokens`: runs of `micro_batch_size` rows in that order, as many as padded rows
    would make (FSDP's ranks must run as many passes as each other). With `max_tokens`: whole groups
    fill a run while its rows stay within `micro_batch_size` and its packed tokens (each prompt once
    + every response's attended tokens) within `max_tokens`, so a group's prompt is computed once; a
    group too big for a run of its own is cut into runs of its rows (each run computing the prompt),
    a row over the budget alone.
    """
    groups = prompt_groups(prompt_ids, prompt_mask).tolist()
    order = sorted(range(len(groups)), key=lambda row: (groups[row], row))
    if max_tokens is None:
        return [
            torch.tensor(order[i : i + micro_batch_size], dtype=torch.int64)
            for i in range(0, len(order), micro_batch_size)
        ]
    prompt_lengths = prompt_mask.sum(dim=1).tolist()
    response_lengths = attended_response_lengths(attention)
    members: dict[int, list[int]] = {}
    for row in order:
        members.setdefault(groups[row], []).append(row)
    runs: list[list[int]] = []
    run_tokens = 0
    for rows in members.values():
        tokens = prompt_lengths[rows[0]] + sum(response_lengths[row] for row in rows)
        if runs and len(runs[-1]) + len(rows) <= micro_batch_size and run_tokens + tokens <= max_tokens:
            runs[-1] += rows
            run_tokens += tokens
            continue
        if len(rows) <= micro_batch_size and tokens <= max_tokens:
            runs.append(list(rows))
            run_tokens = tokens
            continue
        runs.append([])  # the group alone is over a run's limits: its rows in runs of their own
        run_tokens = prompt_lengths[rows[0]]
        for row in rows:
            if runs[-1] and (len(runs[-1]) == micro_batch_size or run_tokens + response_lengths[row] > max_tokens):
                runs.append([])
                run_tokens = prompt_lengths[row]
            runs[-1].append(row)
            run_tokens += response_lengths[row]
    return [torch.tensor(run, dtype=torch.int64) for run in runs]


@dataclass(frozen=True)
class PackedPass:
    """One packed forward pass over some rows of a batch."""

    input_ids: Tensor  # (1, N) int64
    position_ids: Tensor  # (1, N) int64
    attention_mask: Tensor  # (1, 1, N, N): boolean (True attends) or additive (0 / dtype min)
    predictors: Tensor  # (b, response_end) int64: the position whose hidden state scores each response token
    # (C,) each: a cell of the pass's rows' (b, PL + SL) token grid, flat, and the packed token that computed
    # it; a shared prompt's tokens once per row holding it (models/routing_replay.py reads them)
    cells: Tensor
    cell_tokens: Tensor


def pack_pass(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    attention: Tensor,
    *,
    response_end: int,
    mask_kind: str,
    dtype: torch.dtype,
) -> PackedPass:
    """Lay the pass's rows (left-padded prompts (b, PL), right-padded responses (b, SL) with their
    contiguous attention mask) end to end: each distinct prompt once, followed by its responses.
    `predictors` columns past a row's own response point at position 0 (nothing is scored there)."""
    device = prompt_ids.device
    groups = prompt_groups(prompt_ids, prompt_mask).tolist()
    response_lengths = attended_response_lengths(attention)
    pieces: list[Tensor] = []  # token ids, in packed order
    positions: list[Tensor] = []
    owners: list[Tensor] = []  # per token: -1 - group for a prompt token, the row for a response token
    predictors = torch.zeros(len(groups), response_end, dtype=torch.int64, device=device)  # (b, response_end)
    length = 0
    last_prompt_token: dict[int, int] = {}
    width = prompt_ids.shape[1] + response_ids.shape[1]  # a row of the token grid: PL + SL
    cells: list[Tensor] = []
    cell_tokens: list[Tensor] = []
    for row in sorted(range(len(groups)), key=lambda r: (groups[r], r)):
        group = groups[row]
        prompt_columns = prompt_mask[row].bool().nonzero().squeeze(1)  # (P,)
        if group not in last_prompt_token:
            prompt = prompt_ids[row][prompt_columns]  # (P,)
            pieces.append(prompt)
            positions.append(torch.arange(len(prompt), device=device))
            owners.append(torch.full((len(prompt),), -1 - group, device=device))
            length += len(prompt)
            last_prompt_token[group] = length - 1
        prompt_length = int(prompt_mask[row].sum())
        cells.append(row * width + prompt_columns)
        cell_tokens.append(last_prompt_token[group] - prompt_length + 1 + torch.arange(prompt_length, device=device))
        n = response_lengths[row]
        cells.append(row * width + prompt_ids.shape[1] + torch.arange(n, device=device))
        cell_tokens.append(length + torch.arange(n, device=device))
        pieces.append(response_ids[row, :n])
        positions.append(prompt_length + torch.arange(n, device=device))
        owners.append(torch.full((n,), row, device=device))
        # Token 0 is scored by the prompt's last token, token t by token t - 1 of this response.
        if n:
            predictors[row, 0] = last_prompt_token[group]
            predictors[row, 1:n] = length + torch.arange(n - 1, device=device)
        length += n
    owner = torch.cat(owners)  # (N,)
    owner_group = torch.where(
        owner < 0, -1 - owner, torch.tensor(groups, device=device)[owner.clamp(min=0)]
    )  # (N,) the group each token belongs to
    # Token i attends token j <= i of its own group that is a prompt token or in its own response.
    same_group = owner_group[:, None] == owner_group[None, :]  # (N, N)
    visible = (owner[None, :] < 0) | (owner[None, :] == owner[:, None])
    allowed = same_group & visible & torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if mask_kind == "boolean":
        mask = allowed
    else:
        mask = torch.zeros(length, length, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    return PackedPass(
        input_ids=torch.cat(pieces)[None],
        position_ids=torch.cat(positions)[None],
        attention_mask=mask[None, None],
        predictors=predictors,
        cells=torch.cat(cells),
        cell_tokens=torch.cat(cell_tokens),
    )


def mask_kind(model: nn.Module) -> str:
    """The 4D mask a packed pass gives `model` (`packs_sequences` must hold)."""
    return _MASK_KINDS[hf_config(model)._attn_implementation]
