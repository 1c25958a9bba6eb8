"""Loads a Hugging Face format causal LM and tokenizer, and converts between text and the dock's
padded token tensors.

The tensor layout follows docs/architecture.md: prompts left-padded to PL (so every prompt ends at
the same column and generation continues from there), answers and responses right-padded, masks
1 on real tokens. Encoded prompts start with BOS (the tokenizer's post-processor adds it) and end
with the task's prompt text, after which the model writes the answer and then EOS.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedTokenizerFast

from rldock.runtime.models.pipeline_stage import StageNames, StageParts, cut_stage, stage_cut, stage_layers

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
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    stage: tuple[int, int] | None = None,
    head: bool = True,
) -> PreTrainedModel:
    """The causal LM saved at `path` (model.path), in `dtype` (model.dtype), on `device`.

    `stage` (stage, stages) under pipeline parallelism: only that stage's parameters are read, the model cut
    as models/pipeline_stage.py's `cut_stage` cuts it (`_load_stage`); `head=False` there leaves out the LM
    head (the critic's value model has its own). A folder the stage loader cannot read by name loads whole and
    is cut after, said in the log."""
    # Imported here: transformers' model classes cost a process ~3 s of CPU, and the processes that
    # only tokenise (the reward worker, the driver without a warm-up) never load a model.
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        assert dtype in DTYPES, f"dtype {dtype!r} is none of {sorted(DTYPES)} (model.dtype's values)"
        dtype = DTYPES[dtype]
    model = None if stage is None else _load_stage(Path(path), dtype=dtype, stage=stage, head=head)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        if stage is not None:
            if not head:
                model.lm_head = nn.Identity()
            cut_stage(model, index=stage[0], size=stage[1])
    return model.to(device)  # type: ignore[arg-type]  # transformers' `to` wrapper hides torch's signature


def _load_stage(path: Path, *, dtype: torch.dtype, stage: tuple[int, int], head: bool) -> PreTrainedModel | None:
    """Stage `stage` (stage, stages) of the causal LM at `path`, reading only its tensors; None (with the
    reason logged) where the folder's tensors cannot be picked by name.

    Transformers' own loading does the work (its meta-device skeleton, the checkpoint's conversions such as
    an MoE's per-expert tensors fused, the buffers no checkpoint holds, the rotary frequencies among them)
    on a skeleton cut to the stage as soon as it is built, fed the stage's tensors alone, renamed to the
    stage's names (`{decoder}.layers.{i}` is the stage's i-th layer) and read lazily from the safetensors
    files: a stage never holds another's layers. A tied model's last stage reads its head from the
    embedding's tensor."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, GenerationConfig

    files = _safetensors_files(path)
    if files is None:
        logger.info("%s has no safetensors files: stage %d of %d loads the whole model, then cuts it", path, *stage)
        return None
    index, stages = stage
    parts, config = StageParts(), AutoConfig.from_pretrained(str(path))
    layers = stage_layers(config.num_hidden_layers, stages)[index]
    base: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]

    class StageSkeleton(base):  # built on the meta device inside from_pretrained, before any tensor is read
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # The tie the whole model's loading ends with (from_pretrained holds tie_weights off while it builds a
            # skeleton), so that the cut sees a tied head as the embedding's tensor and gives the last stage a copy.
            embedding = f"{parts.decoder}.embed_tokens.weight"
            if self.all_tied_weights_keys.get(f"{parts.head}.weight") == embedding:
                getattr(self, parts.head).weight = self.get_parameter(embedding)
            if not head:
                setattr(self, parts.head, nn.Identity())
            cut_stage(self, index=index, size=stages)
            # the last stage's head is a tensor of its own (a tied model's copy): no tie for transformers to make
            self.all_tied_weights_keys: dict[str, str] = {}

    with ExitStack() as opened:
        tensors: dict[str, Any] = {}  # the checkpoint's name -> the open file that holds it
        for file in files:
            handle = opened.enter_context(safe_open(str(file), framework="pt"))
            tensors |= dict.fromkeys(handle.keys(), handle)
        strays = sorted(name for name in tensors if not name.startswith((f"{parts.decoder}.", f"{parts.head}.")))
        if strays:
            reason = f"tensors outside {parts.decoder} and {parts.head} ({strays[0]})"
            logger.info("%s holds %s: stage %d of %d loads the whole model, then cuts it", path, reason, index, stages)
            return None
        picked = _stage_tensors(list(tensors), layers=layers, index=index, stages=stages, head=head, parts=parts)
        # lazy slices: transformers reads each as it loads it into the stage's skeleton
        state = {local: tensors[name].get_slice(name) for local, name in picked.items()}
        model = StageSkeleton.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    model.__class__ = base  # the skeleton's class did its part: the model is the architecture's own
    model.config.name_or_path = str(path)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(path))
    cut = stage_cut(model)
    assert cut is not None and cut.layers == layers, f"stage {index} of {stages} holds layers {layers}"
    return model


def _stage_tensors(
    names: list[str], *, layers: range, index: int, stages: int, head: bool, parts: StageParts
) -> dict[str, str]:
    """The stage's name -> the checkpoint's, for the tensors stage `index` of `stages` (`layers`) holds: its
    layers', the embedding on the first, the final norm and the head (`head`) on the last, where a tied
    checkpoint (no head tensor) gives the head the embedding's."""
    local = StageNames(layers, decoder=parts.decoder).local
    first, last = index == 0, index == stages - 1
    picked: dict[str, str] = {}
    for name in names:
        if name.startswith(f"{parts.decoder}.layers."):
            if (mine := local(name)) is not None:
                picked[mine] = name
        elif name.startswith(f"{parts.decoder}.embed_tokens."):
            if first:
                picked[name] = name
        elif name.startswith(f"{parts.head}."):
            if last and head:
                picked[name] = name
        elif last:  # the final norm, after the layers
            picked[name] = name
    embedding = f"{parts.decoder}.embed_tokens.weight"
    if last and head and f"{parts.head}.weight" not in picked and embedding in names:
        picked[f"{parts.head}.weight"] = embedding
    return picked


def _safetensors_files(path: Path) -> list[Path] | None:
    """The model's safetensors files (sharded: as its index lists them), or None where it has none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = path / "model.safetensors"
    return [single] if single.is_file() else None


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
