"""Tolerances for two float32 results of one computation taken in different orders, derived from
the computation instead of tuned on one CPU.

The same sums come out in different orders between a micro-batched step and a whole-batch one, and
between CPUs: ATen chooses its kernels by the CPU's vector width (AVX-512, AVX2 or the scalar
`default`, which ATEN_CPU_CAPABILITY forces) and splits reductions over its threads. Recursive
summation of n terms in float32 is off by at most about n * eps times the sum of the terms'
magnitudes, and a chain of sums (a backward pass through several layers) adds its links' errors.
So two orders of one result differ by at most about

    num_terms * eps * scale

where `num_terms` is the length of the longest chain of sums behind an element (say what it is where
you call this) and `scale` the largest magnitude of the compared tensor, which stands in for the
terms' magnitudes. An element-wise relative tolerance does not hold: an element near zero that
is a difference of larger terms keeps their absolute rounding error (issue 60: 20 of 1,280 elements
of a gradient differed by 1.1e-7 on values up to 9.7e-3, 95 eps of the tensor's scale, on AVX-512
only). Any real mistake (a micro-batch weighted wrongly, a term dropped) is orders larger.
"""

from __future__ import annotations

import torch

EPS32 = torch.finfo(torch.float32).eps


def reordered_atol(expected: torch.Tensor, *, num_terms: int) -> float:
    """The absolute tolerance between `expected` and the same float32 result summed in another
    order over chains of at most `num_terms` terms (module docstring)."""
    if num_terms < 1:
        raise ValueError(f"num_terms must be at least 1, got {num_terms}")
    return num_terms * EPS32 * float(expected.detach().abs().max())


def assert_close_reordered(actual: torch.Tensor, expected: torch.Tensor, *, num_terms: int, msg: str = "") -> None:
    """`actual` equals `expected` within reordered_atol (no relative part: module docstring)."""
    atol = reordered_atol(expected, num_terms=num_terms)
    torch.testing.assert_close(
        actual, expected, rtol=0.0, atol=atol, msg=lambda found: f"{msg} (num_terms {num_terms}): {found}"
    )
