"""Loads a Hugging Face format causal LM and tokenizer, and converts between text and the dock's
padded token tensors.

The tensor layout follows docs/architecture.md: prompts left-padded to PL (so every prompt ends at
the same column and generation continues from there), answers and responses right-padded, masks
1 on real tokens. Encoded prompts start with BOS (the tokenizer's post-processor adds it) and end
with the task's prompt text, after which the model writes the answer and then EOS.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TokenBatch(NamedTuple):
    ids: torch.Tensor  # (B, L) int64
    mask: torch.Tensor  # (B, L) int64, 1 on real tokens


class TokenizerError(ValueError):
    """A model folder whose tokenizer cannot be loaded; the message starts with the config field."""


def read_tokenizer(path: str | Path, *, field: str) -> PreTrainedTokenizerFast:
    """The fast tokenizer saved at `path` as it is (load_tokenizer adds the policy's rules); raises
    TokenizerError, naming `field`, for a folder it cannot load."""
    wanted = "the fast tokenizer's files (tokenizer.json, tokenizer_config.json) as save_pretrained writes them"
    if not (Path(path) / "tokenizer.json").is_file():
        raise TokenizerError(f"{field}: {path} has no tokenizer.json; the folder needs {wanted}")
    try:
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as error:  # broad on purpose: tokenizers raises a bare Exception for a tokenizer.json
        # it cannot parse, transformers KeyError, TypeError, ValueError or OSError for other broken files;
        # each is the folder's fault, to be named as such instead of shown as a traceback
        reason = " ".join(str(error).split())[:200] or type(error).__name__
        raise TokenizerError(
            f"{field}: the tokenizer in {path} cannot be loaded ({reason}); the folder needs {wanted}"
        ) from error


def load_tokenizer(path: str | Path, *, field: str = "model.path") -> PreTrainedTokenizerFast:
    """The tokenizer saved at `path` (the config field `field`).

    Loaded as PreTrainedTokenizerFast explicitly: in transformers 5.x AutoTokenizer on a folder
    whose config says Qwen2 may build Qwen's own tokenizer class instead of the one saved there.
    An eos token is required (generation stops on it). A missing pad token falls back to eos, as
    many checkpoints ship without one: pads only fill masked positions, so which id they carry
    does not change any logprob or loss. Raises TokenizerError for a folder it cannot load.
    """
    tokenizer = read_tokenizer(path, field=field)
    if tokenizer.eos_token_id is None:
        raise TokenizerError(
            f"{field}: the tokenizer in {path} defines no eos token; set eos_token in its "
            "tokenizer_config.json (generation stops on it)"
        )
    if tokenizer.pad_token_id is None:
        logger.info("tokenizer at %s defines no pad token; padding with eos %r", path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    path: str | Path, *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu"
) -> PreTrainedModel:
    """The causal LM saved at `path` (model.path), in `dtype` (model.dtype), on `device`."""
    # Imported here: transformers' model classes cost a process ~3 s of CPU, and the processes that
    # only tokenise (the reward worker, the driver without a warm-up) never load a model.
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        assert dtype in DTYPES, f"dtype {dtype!r} is none of {sorted(DTYPES)} (model.dtype's values)"
        dtype = DTYPES[dtype]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device)  # type: ignore[arg-type]  # transformers' `to` wrapper hides torch's signature


def _token_lists(
    tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], *, add_special_tokens: bool
) -> list[list[int]]:
    return tokenizer(list(texts), add_special_tokens=add_special_tokens)["input_ids"]


def _pad(rows: list[list[int]], length: int, pad_id: int, *, left: bool) -> TokenBatch:
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)  # (B, L)
    mask = torch.zeros((len(rows), length), dtype=torch.int64)  # (B, L)
    for i, row in enumerate(rows):
        if not row:
            continue
        cols = slice(length - len(row), length) if left else slice(0, len(row))
        ids[i, cols] = torch.tensor(row, dtype=torch.int64)
        mask[i, cols] = 1
    return TokenBatch(ids, mask)


def encode_prompts(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], max_length: int) -> TokenBatch:
    """Prompts as BOS + tokens, left-padded to `max_length` (algorithm.max_prompt_length, PL).

    Raises ValueError for a prompt longer than PL: cutting it would change the question.
    """
    rows = _token_lists(tokenizer, texts, add_special_tokens=True)
    for text, row in zip(texts, rows):
        if len(row) > max_length:
            raise ValueError(
                f"prompt {text!r} is {len(row)} tokens (with BOS), longer than "
                f"algorithm.max_prompt_length={max_length}; raise it"
            )
    return _pad(rows, max_length, tokenizer.pad_token_id, left=True)


def pad_prompts(rows: Sequence[Sequence[int]], max_length: int, pad_id: int) -> TokenBatch:
    """Prompt token ids (already rendered and length-checked by the data package) left-padded to
    `max_length` (PL)."""
    for row in rows:
        assert len(row) <= max_length, "the prompt set drops prompts longer than PL"
    return _pad([list(row) for row in rows], max_length, pad_id, left=True)


def encode_answers(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], max_length: int) -> TokenBatch:
    """Reference answers as tokens (no BOS/EOS), right-padded to `max_length` (A)."""
    rows = _token_lists(tokenizer, texts, add_special_tokens=False)
    for text, row in zip(texts, rows):
        if len(row) > max_length:
            raise ValueError(f"answer {text!r} is {len(row)} tokens, longer than the answer width {max_length}")
    return _pad(rows, max_length, tokenizer.pad_token_id, left=False)


def max_token_length(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str], *, add_special_tokens: bool) -> int:
    """Longest tokenization of `texts`: sizes PL (prompts, with BOS) or A (answers, without)."""
    return max((len(row) for row in _token_lists(tokenizer, texts, add_special_tokens=add_special_tokens)), default=0)


def decode_responses(tokenizer: PreTrainedTokenizerFast, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
    """Response texts from right-padded `ids` (B, SL) and `mask` (B, SL): tokens up to the first
    EOS, with special tokens dropped."""
    eos = tokenizer.eos_token_id
    texts: list[str] = []
    for row, row_mask in zip(ids.tolist(), mask.tolist()):
        tokens = [t for t, m in zip(row, row_mask) if m]
        if eos in tokens:
            tokens = tokens[: tokens.index(eos)]
        texts.append(cast(str, tokenizer.decode(tokens, skip_special_tokens=True)))  # one sequence: one str
    return texts
