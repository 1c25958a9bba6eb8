"""A decoder-only model's shape (from a HF config.json or a built-in preset) and its parameter counts.

Counts follow the Llama / Qwen2 / Qwen3 layer: an attention block (planning/attention_shapes.py: q, k, v, o
projections, q/k/v biases in Qwen2, per-head q/k norms in Qwen3; DeepSeek-V3's multi-head latent attention),
a SwiGLU MLP (gate, up, down), two RMSNorms per layer, a final norm, the token embedding and an LM head
unless tied. An MoE layer (Qwen3-MoE, Mixtral, DeepSeek-V3) has instead a router (hidden x experts, plus
DeepSeek-V3's per-expert score-correction bias) and `num_experts` SwiGLU experts of width
`moe_intermediate_size`, of which `num_experts_per_tok` run per token, beside DeepSeek's shared experts
(`shared_expert_intermediate_size` wide, run by every token): its total parameters count every expert,
its active parameters the router, the shared experts and k experts. DeepSeek-V3's first
`first_dense_layers` layers (first_k_dense_replace) have a dense MLP of `intermediate_size` instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rldock.runtime.planning.attention_shapes import Attention, GroupedQueryAttention, LatentAttention


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # under MLA, a query's and key's (qk_nope + qk_rope); the figures below read `attention`
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_dense_layers: int = 0  # an MoE model's leading dense layers (DeepSeek's first_k_dense_replace)
    shared_expert_intermediate_size: int = 0  # an MoE layer's shared experts' width (DeepSeek: n_shared x moe width)
    router_bias: bool = False  # an MoE router's per-expert score-correction bias (DeepSeek-V3)
    latent_attention: LatentAttention | None = None  # MLA in place of grouped-query attention

    @property
    def attention(self) -> Attention:
        """The attention block: the latent one where the model has it, else grouped-query from the fields."""
        if self.latent_attention is not None:
            return self.latent_attention
        return GroupedQueryAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.qkv_bias, self.qk_norm)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.moe_layers_in(range(self.num_layers))

    def moe_layers_in(self, layers: range) -> int:
        """How many of the decoder layers `layers` (indices) are MoE layers: those from first_dense_layers on."""
        return len(range(max(layers.start, self.first_dense_layers), layers.stop)) if self.is_moe else 0

    @property
    def expert_params(self) -> int:
        """One MoE layer's routed experts (all of them; what EP splits); 0 for a dense model."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def mlp_params(self) -> int:
        """The largest layer's MLP: the dense SwiGLU, or an MoE layer's router, its experts and shared experts."""
        if not self.is_moe:
            return self.dense_mlp_params
        router = self.hidden_size * self.num_experts + (self.num_experts if self.router_bias else 0)
        return router + self.expert_params + 3 * self.hidden_size * self.shared_expert_intermediate_size

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token runs through: the dense width, or k experts' widths (and the shared ones')."""
        if not self.is_moe:
            return self.intermediate_size
        return self.num_experts_per_tok * self.moe_intermediate_size + self.shared_expert_intermediate_size

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: every MoE layer's experts but its k left out."""
        inactive = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params - self.num_moe_layers * inactive

    @property
    def embedding_params(self) -> int:
        """The token embedding plus the LM head when it is a separate matrix."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def dense_layer_params(self) -> int:
        """A decoder layer with a dense MLP: a dense model's every layer, an MoE model's first_dense_layers."""
        return self.attention.params(self.hidden_size) + self.dense_mlp_params + 2 * self.hidden_size

    @property
    def layer_params(self) -> int:
        """The largest decoder layer: an MoE model's MoE layer, a dense model's every layer."""
        return self.attention.params(self.hidden_size) + self.mlp_params + 2 * self.hidden_size

    def layers_params(self, layers: range) -> int:
        """The parameters of the decoder layers `layers` (indices)."""
        moe = self.moe_layers_in(layers)
        return moe * self.layer_params + (len(layers) - moe) * self.dense_layer_params

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.layers_params(range(self.num_layers)) + self.hidden_size  # + final norm

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """A cached token's keys and values (MLA: its latent and rope key) over all layers."""
        return self.num_layers * self.attention.cache_width * dtype_bytes


def layer_flops(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> tuple[float, float]:
    """One Llama/Qwen-style decoder layer's forward FLOPs per token (its linear layers) and per
    attended (query, key) pair (scores and the weighted sum of values): the runtime's count
    (driver/utilisation.py) and the workers' packing decision (engines/packing.py) share it. It counts
    grouped-query attention, the runtime's models'; a DeepSeek-V3 shape's fields (128 heads and KV heads
    of head_dim 192) would count MLA's projections as full per-head q, k, v of 192 dims, about 3.8 times
    its 187M attention weights (planning/attention_shapes.py), so rldock records no MFU for MLA models,
    which it does not train (docs/scaling.md)."""
    projections = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    per_token = 2.0 * (projections + 3 * hidden * intermediate)  # a gated MLP: gate, up, down (MoE: k experts' width)
    per_pair = 4.0 * heads * head_dim  # q.k and the weighted sum of v
    return per_token, per_pair


def shape_from_hf_config(config: dict, *, name: str) -> ModelShape:
    """The shape of a HF config.json's dict (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, DeepSeek-V3 and kin)."""
    heads = config["num_attention_heads"]
    model_type = config.get("model_type", "")
    num_experts = int(
        config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0
    )
    moe = {}
    if num_experts:  # Mixtral's experts are intermediate_size wide; Qwen-MoE's and DeepSeek's moe_intermediate_size
        width = int(config.get("moe_intermediate_size") or config["intermediate_size"])
        moe = {
            "num_experts": num_experts,
            "num_experts_per_tok": int(config["num_experts_per_tok"]),
            "moe_intermediate_size": width,
            "first_dense_layers": int(config.get("first_k_dense_replace") or 0),
            "shared_expert_intermediate_size": int(config.get("n_shared_experts") or 0) * width,
            "router_bias": model_type == "deepseek_v3",  # e_score_correction_bias, kept in float32 beside the gate
        }
    latent = None
    if config.get("kv_lora_rank"):  # DeepSeek's multi-head latent attention
        latent = LatentAttention(
            num_heads=heads,
            q_lora_rank=int(config.get("q_lora_rank") or 0),
            kv_lora_rank=int(config["kv_lora_rank"]),
            qk_nope_head_dim=int(config["qk_nope_head_dim"]),
            qk_rope_head_dim=int(config["qk_rope_head_dim"]),
            v_head_dim=int(config["v_head_dim"]),
        )
    return ModelShape(
        name=name,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=latent.qk_head_dim if latent else config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        latent_attention=latent,
        **moe,
    )


# deepseek-ai/DeepSeek-R1's config.json (DeepSeek-V3's architecture and sizes; the fields the shape reads). Its
# num_nextn_predict_layers 1 multi-token-prediction module (14B parameters in the checkpoint) is left out, as
# Hugging Face's DeepseekV3ForCausalLM leaves it out: the shape counts the 61 decoder layers, 671.03B parameters
# (DeepSeek's 671B), 37.55B of them active per token (DeepSeek's 37B, embedding and head included).
DEEPSEEK_R1_CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


# The paper's models (MindSpeed RL trains Qwen2.5-7B and -32B, Qwen3-MoE-30B and DeepSeek-R1-671B), from their
# published config.json files.
PRESETS: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape(
        "Qwen2.5-7B",
        vocab_size=152064,
        hidden_size=3584,
        num_layers=28,
        num_heads=28,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=18944,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
    "qwen2.5-32b": ModelShape(
        "Qwen2.5-32B",
        vocab_size=152064,
        hidden_size=5120,
        num_layers=64,
        num_heads=40,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=27648,
        tie_word_embeddings=False,
        qkv_bias=True,
    ),
    # The paper's MoE model (MindSpeed RL trains Qwen3-MoE-30B): Qwen/Qwen3-30B-A3B's config.json.
    "qwen3-30b-a3b": ModelShape(
        "Qwen3-30B-A3B",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        intermediate_size=6144,
        tie_word_embeddings=False,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # The paper's large-scale MoE model (MindSpeed RL trains DeepSeek-R1-MoE-671B).
    "deepseek-r1-671b": shape_from_hf_config(DEEPSEEK_R1_CONFIG, name="DeepSeek-R1-671B"),
}


def load_shape(*, preset: str | None, model_path: str) -> ModelShape:
    """A preset by name, else the config.json in `model_path` (the job's model.path)."""
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
        return PRESETS[preset]
    path = Path(model_path) / "config.json"  # `~` and `$VARS` expanded by the loader (config/paths.py)
    if not path.is_file():
        raise ValueError(
            f"model.path: {path} not found; point model.path at a Hugging Face model folder or "
            f"pass --model-preset ({', '.join(sorted(PRESETS))})"
        )
    return shape_from_hf_config(json.loads(path.read_text()), name=Path(model_path).name)
