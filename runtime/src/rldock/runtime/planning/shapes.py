"""A decoder-only model's shape (from a HF config.json or a built-in preset) and its parameter counts.

Counts follow the Llama / Qwen2 / Qwen3 layer: q, k, v, o projections (q/k/v biases in Qwen2),
a SwiGLU MLP (gate, up, down), two RMSNorms per layer (plus per-head q/k norms in Qwen3), a final
norm, the token embedding and an LM head unless tied. An MoE layer (Qwen3-MoE, Mixtral) has instead
a router (hidden x experts) and `num_experts` SwiGLU experts of width `moe_intermediate_size`, of
which `num_experts_per_tok` run per token: its total parameters count every expert, its active
parameters the router and k experts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0  # 0: a dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_params(self) -> int:
        """One layer's experts (all of them); 0 for a dense model."""
        return self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def mlp_params(self) -> int:
        """One layer's MLP: the dense SwiGLU, or the router and every expert."""
        if self.is_moe:
            return self.hidden_size * self.num_experts + self.expert_params
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token runs through: the dense width, or k experts' widths."""
        return self.num_experts_per_tok * self.moe_intermediate_size if self.is_moe else self.intermediate_size

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: every expert but its k left out."""
        inactive = (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size * self.moe_intermediate_size
        return self.num_params - self.num_layers * (inactive if self.is_moe else 0)

    @property
    def embedding_params(self) -> int:
        """The token embedding plus the LM head when it is a separate matrix."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = self.mlp_params
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return attention + mlp + norms

    @property
    def num_params(self) -> int:
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size  # + final norm

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """A cached token's keys and values over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def layer_flops(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> tuple[float, float]:
    """One Llama/Qwen-style decoder layer's forward FLOPs per token (its linear layers) and per
    attended (query, key) pair (scores and the weighted sum of values): the runtime's count
    (driver/utilisation.py) and the workers' packing decision (engines/packing.py) share it."""
    projections = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o; k, v
    per_token = 2.0 * (projections + 3 * hidden * intermediate)  # a gated MLP: gate, up, down (MoE: k experts' width)
    per_pair = 4.0 * heads * head_dim  # q.k and the weighted sum of v
    return per_token, per_pair


# The paper's models (MindSpeed RL trains Qwen2.5-7B and -32B), from their published config.json files.
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
}


def shape_from_hf_config(config: dict, *, name: str) -> ModelShape:
    """The shape of a HF config.json's dict (Llama, Qwen2, Qwen3 and kin)."""
    heads = config["num_attention_heads"]
    model_type = config.get("model_type", "")
    num_experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    moe = {}
    if num_experts:  # Mixtral's experts are intermediate_size wide; Qwen-MoE's moe_intermediate_size
        moe = {
            "num_experts": num_experts,
            "num_experts_per_tok": int(config["num_experts_per_tok"]),
            "moe_intermediate_size": int(config.get("moe_intermediate_size") or config["intermediate_size"]),
        }
    return ModelShape(
        name=name,
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **moe,
    )


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
