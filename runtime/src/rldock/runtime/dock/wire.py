"""How tensors travel between the dock client and its warehouses: as numpy arrays.

Ray serialises numpy arrays out of band into its shared-memory object store and hands them to a
reader on the same node without a copy, while torch tensors are pickled (copied) unless
RAY_ENABLE_ZERO_COPY_TORCH_TENSORS is set for the whole cluster. numpy has no bfloat16 or float8
types, so such columns travel as same-width integer views with their torch dtype alongside.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np
import torch

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_READ_ONLY_WARNING = "The given NumPy array is not writable"


class WireColumn(NamedTuple):
    """One column on the wire: the array (B, ...) and the torch dtype it stands for."""

    array: np.ndarray
    dtype: torch.dtype


def to_wire(tensor: torch.Tensor) -> WireColumn:
    """A numpy view of `tensor` (copied to host first if it lives on a device)."""
    host = tensor.detach().cpu()
    try:
        return WireColumn(host.numpy(), host.dtype)
    except TypeError:  # numpy has no such dtype (bfloat16, float8, ...)
        return WireColumn(host.view(_SAME_WIDTH_INT[host.element_size()]).numpy(), host.dtype)


def from_wire(column: WireColumn) -> torch.Tensor:
    """A tensor sharing memory with `column.array`.

    Arrays that Ray returns from its object store are read-only; torch warns about that on every
    call. The returned tensor owns a private copy of the object (no other reader sees it), so
    in-place edits are harmless and the warning is noise.
    """
    if column.array.flags.writeable:  # rows copied out of shared memory: nothing to silence
        tensor = torch.from_numpy(column.array)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
            tensor = torch.from_numpy(column.array)
    return tensor if tensor.dtype == column.dtype else tensor.view(column.dtype)
