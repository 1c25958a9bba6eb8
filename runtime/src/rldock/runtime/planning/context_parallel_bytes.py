"""What context parallelism (training.context_parallel_size; Ulysses, engines/ulysses.py, or ring
attention, engines/ring_attention.py, by training.context_parallel_mode) changes in a rank's bytes,
as arithmetic on the model shape:

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

Ring attention instead keeps every head of its n positions: its attention function saves the rank's
q, k and v (as the kernel's are counted), and its merged output and log-sum-exps in float32
(n (n_q d + n_q) four-byte elements, `ring_saved_width`); no head-sharded copies. Transient, in a layer's
backward: two float32 (n_q, t, t) tiles (a tile's probabilities and their gradient) and the causal
pass's (t, t) boolean comparison, t = min(n, RING_TILE_POSITIONS): a step computes its block a tile of query
rows by a tile of key columns at a time, as FlashAttention does, so its scores do not grow with the
sequence; beside them the step's O(n) float32 gradients and the key-and-value blocks in transit
(`ring_block_bytes`). Its traffic per
layer and pass: the forward passes cp - 1 key-and-value blocks of n 2 n_kv d elements on; the
backward passes them on again (cp - 1) and the blocks' float32 gradients cp times.
"""

from __future__ import annotations

from rldock.runtime.planning.shapes import ModelShape

# Query rows and key columns of the score tiles a ring-attention step computes at once
# (engines/ring_attention.py reads it from here). 512 keeps a tile at H MiB in float32 (a 28-head rank's tile
# 28 MiB, a backward step's two 56 MiB) while a step's tiles stay few: on the CPU each tile's matmuls are large
# enough to run at the kernel's speed, on an accelerator each tile costs its kernels' launches (a fused
# kernel would replace the loop there). The (n, n) blocks the tiles replace were 924 GiB at the paper's
# 133,120-token 7B sequences on two ranks.
RING_TILE_POSITIONS = 512


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


def ring_saved_width(shape: ModelShape, *, cp: int, element: int) -> int:
    """Elements (of `element` bytes) per position and layer a ring-attention rank keeps beyond one
    rank's: the float32 merged output and log-sum-exps (module docstring); 0 at cp 1."""
    if cp == 1:
        return 0
    return -(-(shape.num_heads * shape.head_dim + shape.num_heads) * 4 // element)


def ring_block_bytes(shape: ModelShape, *, tokens: int, cp: int, tp: int, element: int) -> int:
    """What a ring-attention rank's backward step holds of a pass of `tokens` tokens at its fullest, beyond what
    autograd keeps (engines/ring_attention.py's `_RingAttention.backward`; n a rank's positions, H and KV a TP
    rank's heads, D the head width, float32 or wider): a tile's probabilities and their gradient, two (H, t, t)
    tiles, and the (t, t) boolean the causal comparison or the mask's negation makes, t = min(n,
    RING_TILE_POSITIONS) (`_tile_backward`, each made in place of the tensor it comes from); and the step's
    O(n) tensors: the output's gradient in float32 and the queries' gradient, (H, n, D) each, the key-and-value
    block and its gradient, (2, KV, n, D) each, with the copy of each the ring's shift receives. At long
    sequences the O(n) tensors are the larger (the 7B job's 133,120 tokens at CP 2: 2.5 GiB of them beside
    56 MiB of tiles); 0 at cp 1 (no ring)."""
    if cp == 1:
        return 0
    n = tokens_per_rank(tokens, cp)
    tile = min(n, RING_TILE_POSITIONS)
    heads, kv_heads, wide = shape.num_heads // tp, max(1, shape.num_kv_heads // tp), max(4, element)
    tiles = tile * tile * (2 * heads * wide + 1)
    gradients = 2 * heads * n * shape.head_dim * wide  # the output's and the queries'
    blocks = 2 * (2 * kv_heads * n * shape.head_dim) * (element + wide)  # the block and its gradient, each twice
    return tiles + gradients + blocks


def ring_bytes_per_pass(
    shape: ModelShape, *, tokens: int, cp: int, element: int, backward: bool = True, recompute: bool = False
) -> int:
    """Bytes one ring-attention rank sends its neighbour in one pass of `tokens` tokens: per layer
    cp - 1 key-and-value blocks forward; the backward's cp - 1 blocks again and cp blocks of their
    float32 gradients; a recomputed forward's blocks once more."""
    if cp == 1:
        return 0
    block = tokens_per_rank(tokens, cp) * 2 * shape.num_kv_heads * shape.head_dim
    forward = (cp - 1) * block * element
    back = (cp - 1) * block * element + cp * block * 4
    passes = forward * (1 + (1 if backward and recompute else 0)) + (back if backward else 0)
    return shape.num_layers * passes


def context_bytes_per_pass(
    shape: ModelShape, *, mode: str, tokens: int, cp: int, element: int, backward: bool = True, recompute: bool = False
) -> int:
    """What a CP rank sends in one pass, by `mode` (`ulysses` or `ring`)."""
    count = ring_bytes_per_pass if mode == "ring" else all_to_all_bytes_per_pass
    return count(shape, tokens=tokens, cp=cp, element=element, backward=backward, recompute=recompute)


def saved_width(shape: ModelShape, *, mode: str, cp: int, element: int) -> int:
    """Elements per position and layer a CP rank keeps beyond one rank's, by `mode`."""
    return ring_saved_width(shape, cp=cp, element=element) if mode == "ring" else ulysses_output_width(shape, cp=cp)
