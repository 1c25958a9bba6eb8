"""How tensors travel between the dock client and its warehouses: as numpy arrays.

Ray serialises numpy arrays out of band into its shared-memory object store and hands them to a
reader on the same node without a copy, while torch tensors are pickled (copied) unless
RAY_ENABLE_ZERO_COPY_TORCH_TENSORS is set for the whole cluster. numpy has no bfloat16 or float8
types, so such columns travel as same-width integer views with their torch dtype alongside.

The torch dtype travels by name ("float32", "bfloat16"): the dock's controller host stores, hands
out and writes to shared memory arrays only, so neither its calls' arguments nor its own modules
import torch (about 1.9 CPU seconds of its start, `tests/unit/runtime/test_startup_imports.py`); torch is
imported where tensors are made and taken apart, in `to_wire` and `from_wire`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

_SAME_WIDTH_INT = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
_READ_ONLY_WARNING = "The given NumPy array is not writable"


class WireColumn(NamedTuple):
    """One column on the wire: the array (B, ...) and the name of the torch dtype it stands for."""

    array: np.ndarray
    dtype: str


def dtype_name(dtype: torch.dtype | str) -> str:
    """torch.bfloat16 (or its name already) -> "bfloat16", as WireColumn carries it."""
    return str(dtype).removeprefix("torch.")


def to_wire(tensor: torch.Tensor) -> WireColumn:
    """A numpy view of `tensor` (copied to host first if it lives on a device)."""
    import torch  # the caller holds a tensor: imported already, a lookup

    host = tensor.detach().cpu()
    try:
        return WireColumn(host.numpy(), dtype_name(host.dtype))
    except TypeError:  # numpy has no such dtype (bfloat16, float8, ...)
        same_width = getattr(torch, _SAME_WIDTH_INT[host.element_size()])
        return WireColumn(host.view(same_width).numpy(), dtype_name(host.dtype))


def from_wire(column: WireColumn) -> torch.Tensor:
    """A tensor sharing memory with `column.array`.

    Arrays that Ray returns from its object store are read-only; torch warns about that on every
    call. The returned tensor owns a private copy of the object (no other reader sees it), so
    in-place edits are harmless and the warning is noise.
    """
    import torch  # imported already where tensors are wanted: a lookup

    if column.array.flags.writeable:  # rows copied out of shared memory: nothing to silence
        tensor = torch.from_numpy(column.array)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_READ_ONLY_WARNING, category=UserWarning)
            tensor = torch.from_numpy(column.array)
    dtype = getattr(torch, column.dtype)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)
