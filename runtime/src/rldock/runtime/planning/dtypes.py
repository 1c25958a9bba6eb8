"""The bytes of one element in each of a job's dtypes, and which dtype each of its passes computes in
(the memory planner's units; planning/memory.py re-exports them)."""

from __future__ import annotations

from rldock.config import JobConfig
from rldock.config.rollout import generation_dtype

GIB = 1024**3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
COMPUTE_BYTES = {"bf16": 2, "fp16": 2}
MIXED_PRECISION_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # training.mixed_precision's compute dtype


def compute_element_bytes(cfg: JobConfig) -> int:
    """Bytes of one element the update's passes compute in: training.mixed_precision's, else model.dtype's."""
    return COMPUTE_BYTES.get(cfg.training.mixed_precision, DTYPE_BYTES[cfg.model.dtype])


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
