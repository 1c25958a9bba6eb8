"""A decoder layer's attention block by kind (planning/shapes.py's `ModelShape.attention`): its parameters, what
tensor parallelism leaves whole on every rank, what autograd keeps of it per token and what a KV cache holds
per token. The rest of the planner reads these four and never asks which kind it has.

- Grouped-query attention (Llama, Qwen2, Qwen3, Mixtral): q, k, v, o projections over n_q query heads and
  n_kv key-value heads of d dims, q/k/v biases in Qwen2, per-head q and k RMSNorms in Qwen3.
- Multi-head latent attention (MLA; DeepSeek-V2/V3, Hugging Face's DeepseekV3Attention): the query through a
  down projection to a q_lora_rank latent (q_a_proj), its RMSNorm (q_a_layernorm) and an up projection to
  n heads of qk_nope + qk_rope dims (q_b_proj); keys and values through one down projection to a
  kv_lora_rank latent plus a qk_rope-wide key every head shares (kv_a_proj_with_mqa), the latent's RMSNorm
  (kv_a_layernorm) and its up projection to n heads of qk_nope key and v_head_dim value dims (kv_b_proj);
  o_proj from n x v_head_dim. A cache holds the latent and the shared rope key, kv_lora_rank + qk_rope_head_dim
  elements per token and layer (vLLM's MLA cache), not per-head keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Attention(Protocol):
    def params(self, hidden: int) -> int:
        """One layer's attention parameters, its norms inside the block included."""
        ...

    def tp_whole_params(self, hidden: int) -> int:
        """Of those, what tensor parallelism leaves whole on every TP rank (the rest split over TP)."""
        ...

    def saved_width(self, tp: int) -> int:
        """Elements per token autograd keeps of the block on one TP rank (the layer's input norm counted by
        the caller; attention scores not kept, as with fused/flash attention)."""
        ...

    @property
    def cache_width(self) -> int:
        """Elements per token and layer a KV cache holds (all TP ranks together)."""
        ...


@dataclass(frozen=True)
class GroupedQueryAttention:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    qk_norm: bool = False

    def params(self, hidden: int) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (
            hidden * q
            + 2 * hidden * kv
            + q * hidden
            + ((q + 2 * kv) if self.qkv_bias else 0)
            + self.tp_whole_params(hidden)
        )

    def tp_whole_params(self, hidden: int) -> int:
        return 2 * self.head_dim if self.qk_norm else 0  # the per-head q and k norms (rldock.contract.tensor_parallel)

    def saved_width(self, tp: int) -> int:
        # q, k, v and the attention output, over TP's heads
        return ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim + self.num_heads * self.head_dim) // tp

    @property
    def cache_width(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim  # a key and a value per KV head


@dataclass(frozen=True)
class LatentAttention:
    num_heads: int
    q_lora_rank: int  # 0: a plain q_proj (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, hidden: int) -> int:
        heads = self.num_heads
        q_up = (self.q_lora_rank or hidden) * heads * self.qk_head_dim  # q_b_proj (q_proj without a latent)
        kv_up = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj
        return self.tp_whole_params(hidden) + q_up + kv_up + heads * self.v_head_dim * hidden  # + o_proj

    def tp_whole_params(self, hidden: int) -> int:
        """The down projections and their norms: vLLM's DeepSeek attention and Megatron's MLA keep them whole
        on every TP rank (replicated linears) and split the up projections and o_proj by heads."""
        q_down = hidden * self.q_lora_rank + self.q_lora_rank  # q_a_proj, q_a_layernorm
        kv_down = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # kv_a_proj, its norm
        return q_down + kv_down

    def saved_width(self, tp: int) -> int:
        # whole: the q latent before and after its norm, the kv down projection's output and the normed latent;
        # per head: q and k (qk_head_dim each), kv_b_proj's output (whose value half attention reads) and the
        # attention output
        whole = 2 * self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim + self.kv_lora_rank
        per_head = 2 * self.qk_head_dim + self.qk_nope_head_dim + 2 * self.v_head_dim
        return whole + self.num_heads * per_head // tp

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim
