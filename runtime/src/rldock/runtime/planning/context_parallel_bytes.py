"""What Ulysses context parallelism (training.context_parallel_size, engines/ulysses.py) changes in
a rank's bytes, as arithmetic on the model shape:

- tokens: a CP rank computes ceil(N / cp) positions of a pass of N tokens (N padded to a multiple
  of cp), so every per-token activation falls by cp;
- the exchange saves nothing itself, and the attention kernel keeps the head-sharded q, k, v and
  output (N (n_q + 2 n_kv) d / cp and N n_q d / cp elements, as many as the rank's own n positions
  with all heads) where one rank keeps its own; but one tensor more per position and layer: without
  CP the kernel's output and the output projection's input are one storage (a view), under CP the
  projection's input is the all-to-all's result, a new tensor, so the rank keeps both, n n_q d
  elements more (`ulysses_output_width`; autograd's saved tensors listed by node, CP 1 against CP 2:
  only SDPA's `output` differs, the rest is 1/cp of one rank's, which is what the saved bytes' 0.526
  of CP 1 at CP 2 in rldock_benchmarks.context_parallel were);
- the 4D mask: a pass with padding or several sequences gives every rank its whole (b, 1, N, N) mask
  (one byte per pair for sdpa's boolean mask), which CP does not divide; a trimmed single row (the
  long-sequence case, micro_batch_size 1) has none, its attention causal over the whole sequence;
- traffic: per layer and pass, the forward sends q, k, v and the output, n (2 n_q + 2 n_kv) d
  elements of a rank, (cp - 1)/cp of them to other ranks; the backward sends their gradients back
  (as much again); gradient checkpointing recomputes the forward (a third time).
"""

from __future__ import annotations

from rldock.runtime.planning.shapes import ModelShape


def tokens_per_rank(tokens: int, cp: int) -> int:
    """Positions a CP rank computes of a pass's `tokens` (padded to a multiple of cp)."""
    return -(-tokens // cp)


def ulysses_output_width(shape: ModelShape, *, cp: int) -> int:
    """Elements per position and layer a CP rank keeps beyond one rank's (module docstring): the
    attention kernel's output, n_q d, apart from the exchanged output the projection keeps; 0 at cp 1."""
    return shape.num_heads * shape.head_dim if cp > 1 else 0


def mask_bytes(*, rows: int, sequence: int, cp: int, element: int = 1) -> int:
    """The whole 4D mask a CP pass gives each rank: rows x N'^2 pairs (N' the sequence padded to a
    multiple of cp) of `element` bytes (0 at cp 1, where the model builds its own)."""
    if cp == 1:
        return 0
    padded = tokens_per_rank(sequence, cp) * cp
    return rows * padded * padded * element


def all_to_all_bytes_per_pass(
    shape: ModelShape, *, tokens: int, cp: int, element: int, backward: bool = True, recompute: bool = False
) -> int:
    """Bytes one CP rank sends to the other ranks of its group in one pass of `tokens` tokens: per
    layer, q, k, v in and the output back ((cp - 1)/cp of its n (2 n_q + 2 n_kv) d elements),
    doubled by the backward and once more by a recomputed forward."""
    if cp == 1:
        return 0
    n = tokens_per_rank(tokens, cp)
    per_layer = n * (2 * shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim * element * (cp - 1) // cp
    passes = 1 + (1 if backward else 0) + (1 if backward and recompute else 0)
    return shape.num_layers * per_layer * passes
