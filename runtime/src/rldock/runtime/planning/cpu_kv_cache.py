"""The KV cache a CPU engine allocates: `rollout.cpu_kv_cache_gib` when set, else what the job's sequences need.

vLLM's CPU engine allocates its whole KV cache at start and writes zeros over it (1 GiB: about 0.4 s of CPU,
and that much resident memory, for as long as the engine lives). The cache a rollout can use is bounded by
what vLLM runs at once: `max_num_seqs` sequences (vLLM's default on a CPU, which the runtime keeps: 256 per
device of the engine's TP, each device holding its share of the KV heads), each in whole blocks (128 tokens on
a CPU) up to the job's longest sequence, plus the one block vLLM keeps back (its null block). Unset, the cache
is that bound, at most `CPU_KV_CACHE_CAP_BYTES` (the setting's former default): a model whose bound is larger
gets the cap, and vLLM then runs fewer sequences at once, as it did. The demo's tiny model takes 32.1 MiB.
"""

from __future__ import annotations

from rldock.config.rollout import RolloutSpec
from rldock.runtime.planning.dtypes import GIB
from rldock.runtime.planning.shapes import ModelShape

CPU_KV_CACHE_CAP_BYTES = GIB
CPU_CONCURRENT_SEQUENCES = 256  # vLLM 0.32's max_num_seqs for the LLM class on a CPU, per device of its TP
CPU_BLOCK_TOKENS = 128  # vLLM 0.32's KV block on a CPU (16 for its portable latent-attention kernel: fewer)


def cpu_kv_cache_bytes(
    rollout: RolloutSpec, shape: ModelShape | None, *, dtype_bytes: int, generation_tp: int, max_model_len: int
) -> int:
    """Bytes of KV cache per device for a CPU engine of `shape` in a dtype of `dtype_bytes`, whose TP
    splits the KV heads over `generation_tp` devices, for sequences of up to `max_model_len` tokens.
    `shape` None (an architecture the planner does not read): the cap."""
    if rollout.cpu_kv_cache_gib is not None:
        return int(rollout.cpu_kv_cache_gib * GIB)
    if shape is None:
        return CPU_KV_CACHE_CAP_BYTES
    blocks = CPU_CONCURRENT_SEQUENCES * generation_tp * -(-max_model_len // CPU_BLOCK_TOKENS) + 1  # + the null block
    tokens = blocks * CPU_BLOCK_TOKENS
    per_token = shape.kv_bytes_per_token(dtype_bytes)
    if shape.latent_attention is None:  # TP splits the KV heads (each device keeps one at least); a latent is whole
        per_token = per_token * max(1, shape.num_kv_heads // generation_tp) // shape.num_kv_heads
    return min(tokens * per_token, CPU_KV_CACHE_CAP_BYTES)
