"""Masked reductions shared by the losses and estimators."""

from __future__ import annotations

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is nonzero; `values` and `mask` have the same shape (e.g. (B, T)).

    With `dim=None` it is one scalar over all valid elements (the token mean); with a `dim` it
    reduces that dimension only. Rows with no valid element give 0, not NaN.
    """
    mask = mask.to(values.dtype)
    total = (values * mask).sum(dim=dim) if dim is not None else (values * mask).sum()
    count = mask.sum(dim=dim) if dim is not None else mask.sum()
    return total / count.clamp(min=1)
