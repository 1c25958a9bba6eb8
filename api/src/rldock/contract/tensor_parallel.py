"""Tensor-parallel plans kept as data, one per architecture, and the rules every TP size must
satisfy for a model: a known architecture, even shapes.

A plan names, for a decoder layer, how Megatron-style TP splits each linear (colwise: the output
features, weight dim 0 and bias dim 0; rowwise: the input features, weight dim 1, its bias, absent
in these models, would stay whole) and which replicated modules see only a rank's heads, so their
gradients are partial sums to add over the TP group. Modules not named (embeddings, norms, the
tied lm_head) stay replicated. A colwise linear's input gradient is summed over the TP group by the
split itself, so what feeds only split linears needs nothing more. DeepSeek's latent attention has one
exception: the key-value down-projection's last `qk_rope_head_dim` outputs are the rotary key that every
head reads directly, not through a split linear, so each rank's gradient there covers its heads only;
the runtime sums those columns' gradient over the TP group (`partial_output_tails`). The runtime
parallelizes, gathers and checks from these tables (rldock.runtime.resharding); the config check
(rldock.config.problems) reads them without torch.

Heads, KV heads and the MLP width are split evenly over the TP ranks, so each must be divisible by
the TP size. The config checks it before a job starts (naming the field), and the runtime applies
it again when it parallelizes the model it actually loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

TpStyle = Literal["colwise", "rowwise"]


@dataclass(frozen=True)
class TpPlan:
    """How TP splits one architecture's decoder layers: module suffixes under `model.layers.{i}.`."""

    linears: Mapping[str, TpStyle]
    partial_gradient_modules: tuple[str, ...] = ()
    # (replicated module, the config field naming how many of its last outputs the local heads read directly,
    # their gradient a partial sum there)
    partial_output_tails: tuple[tuple[str, str], ...] = ()
    # linears of `linears` a model of the architecture may lack (DeepSeek's query: one projection, or a latent's)
    optional_linears: tuple[str, ...] = ()

    @property
    def splits_mlp(self) -> bool:
        """Whether the plan splits the dense MLP (so its width must divide by the TP size)."""
        return any(suffix.startswith("mlp.") for suffix in self.linears)


# Llama's decoder linears; Qwen2 and Qwen3 name theirs the same (Qwen2's q/k/v carry biases,
# which split with their colwise weights).
_LLAMA_LINEARS: Mapping[str, TpStyle] = MappingProxyType(
    {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
    }
)

# A mixture-of-experts layer's attention is Qwen3's; its experts are not split by TP but by expert
# parallelism (every TP rank runs its own EP group over the same tokens), so the plan names the
# attention's linears only (a dense `mlp_only_layers` layer's MLP stays whole on every TP rank).
_ATTENTION_LINEARS: Mapping[str, TpStyle] = MappingProxyType(
    {suffix: style for suffix, style in _LLAMA_LINEARS.items() if suffix.startswith("self_attn.")}
)
_QWEN3_NORMS = ("self_attn.q_norm", "self_attn.k_norm")

# config.json `model_type` -> plan. Each architecture's attention reshapes with -1 heads, so it
# runs on a rank's local heads unchanged. Qwen3 adds per-head RMSNorms on q and k, applied after
# the colwise projections: replicated, each TP rank's gradient for them covers only its heads.
TP_PLANS: Mapping[str, TpPlan] = MappingProxyType(
    {
        "llama": TpPlan(_LLAMA_LINEARS),
        "qwen2": TpPlan(_LLAMA_LINEARS),
        "qwen3": TpPlan(_LLAMA_LINEARS, partial_gradient_modules=_QWEN3_NORMS),
        "qwen3_moe": TpPlan(_ATTENTION_LINEARS, partial_gradient_modules=_QWEN3_NORMS),
        # DeepSeek-V3's latent attention: the query (or its up-projection, with a query latent) and the
        # latent's up-projection to each head's keys and values split by heads; the down-projections to the
        # latents and their norms stay whole on every rank. The experts are expert parallelism's, the dense
        # layers' and the shared experts' MLPs stay whole, as Qwen3-MoE's.
        "deepseek_v3": TpPlan(
            MappingProxyType(
                {
                    "self_attn.q_proj": "colwise",
                    "self_attn.q_b_proj": "colwise",
                    "self_attn.kv_b_proj": "colwise",
                    "self_attn.o_proj": "rowwise",
                }
            ),
            partial_output_tails=(("self_attn.kv_a_proj_with_mqa", "qk_rope_head_dim"),),
            optional_linears=("self_attn.q_proj", "self_attn.q_b_proj"),
        ),
    }
)

TP_ARCHITECTURES = tuple(TP_PLANS)

# The split dimensions of the tiny demo models (rldock.runtime.models.tiny's defaults), for the
# config checks of a job whose tiny model is still to be built: TP 1 or 2 splits them.
TINY_MODEL_SHAPES = {
    "model_type": "qwen2",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
}


def tp_plan(model_type: str | None, *, field: str = "training.tensor_parallel_size > 1") -> TpPlan:
    """The plan for `model_type` (raises naming `field`, the setting that asked for TP, and the
    architectures that have a plan)."""
    plan = TP_PLANS.get(model_type or "")
    if plan is None:
        raise ValueError(
            f"{field} needs a tensor-parallel plan for the model's architecture "
            f"(model_type {model_type!r}); plans exist for {list(TP_ARCHITECTURES)}: "
            "use tensor_parallel_size 1 for this model"
        )
    return plan


def check_architecture(*, tp_size: int, model_type: str | None, field: str) -> None:
    """TP > 1 only for architectures with a plan (raises naming `field` and the architecture)."""
    if tp_size > 1:
        tp_plan(model_type, field=f"{field}={tp_size}")


def check_divisible(
    *, tp_size: int, num_heads: int, num_kv_heads: int, intermediate_size: int | None, field: str
) -> None:
    """Even shards only: every split dimension must divide by `tp_size` (raises naming `field`);
    `intermediate_size` None where the plan leaves the MLP whole (`TpPlan.splits_mlp`)."""
    for what, size in (
        ("num_attention_heads", num_heads),
        ("num_key_value_heads", num_kv_heads),
        ("intermediate_size", intermediate_size),
    ):
        if size is not None and size % tp_size:
            raise ValueError(
                f"{field}={tp_size} does not divide the model's {what} ({size}); "
                "choose a tensor-parallel size that splits every head and MLP evenly"
            )
