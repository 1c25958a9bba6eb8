"""Builds the tiny demo model: a small Qwen2 (or Llama, Qwen3, Qwen3-MoE) causal LM with a character-level
tokenizer trained on the task's text, saved in Hugging Face format so every later stage loads it
like a real model. The other architectures exist so the runtime's paths (load, vLLM generate,
weight sync, tensor parallelism) are tested on each family users bring, at a size that runs in
seconds.

Shapes are chosen for the engines, not only for size: vLLM's CPU attention accepts head sizes
32, 64, 80, ... (16 is refused), so the default is hidden 128 over 4 heads (head_dim 32) with 2
KV heads (grouped-query attention, as in real Qwen2 checkpoints).

The MoE architecture (`qwen3_moe`, Hugging Face's `Qwen3MoeForCausalLM`) has a sparse MLP in every
layer: `num_experts` experts of `intermediate_size // num_experts_per_tok` each, `num_experts_per_tok`
of them per token, so a token's active MLP is about the dense model's. Its folder is written the
way Hub checkpoints are (one tensor per expert, `mlp.experts.{e}.gate_proj.weight`), which
transformers fuses on load and vLLM reads directly.

`deepseek_v3` (Hugging Face's `DeepseekV3ForCausalLM`, the architecture of DeepSeek-V3 and -R1, the paper's
671B model) is that MoE with DeepSeek's parts: multi-head latent attention (keys and values through a
512-wide latent and a 64-wide rotary part: vLLM's CPU MLA kernel is built for 512 + 64 only, so these two
are the real model's whatever the hidden size), a first layer dense (`first_k_dense_replace` 1), a shared
expert beside the routed ones, and the sigmoid router with its bias-corrected choice (`noaux_tc`, one
group). Its LM head is its own (vLLM's DeepSeek model does not tie it to the embedding).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    DeepseekV3Config,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0..3 in this order
# The tiny model's chat template, for jobs that render prompts with one (data.chat_template: model, which
# multi-turn rollouts need): each message is `<role>content` closed by EOS, the tools by name only (the
# warm-up's demonstrations teach the call format), so a character-level model sees short prompts.
CHAT_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function.name }}{% if not loop.last %},{% endif %}"
    "{% endfor %}</tools>{% endif %}"
    "{% for message in messages %}<{{ message.role }}>{{ message.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# model_type -> config class. Qwen3 defaults head_dim to 128 whatever the hidden size, so the
# builder always passes head_dim explicitly.
TINY_ARCHITECTURES: dict[str, Callable[..., PretrainedConfig]] = {
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "deepseek_v3": DeepseekV3Config,
}
MOE_ARCHITECTURES = frozenset({"qwen3_moe", "deepseek_v3"})
# DeepSeek-V3's latent attention: the latent and rotary widths vLLM's CPU MLA kernel takes (module docstring),
# no query latent (as DeepSeek-V2-Lite), the per-head key width of the real model's.
_LATENT_ATTENTION = {"kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}


def train_char_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """A character-level tokenizer whose vocabulary is the special tokens plus every character
    in `texts`; it prepends BOS when encoding with special tokens."""
    tokenizer = Tokenizer(models.WordLevel(unk_token=UNK))
    # Every character is its own token, so digits never merge into multi-digit tokens: the model
    # then writes an answer digit by digit, which is what makes per-digit credit learnable.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.train_from_iterator(texts, trainer=trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # prompts are left-padded (see docs/architecture.md)
    )


def build_tiny_model(
    path: str | Path,
    *,
    texts: Iterable[str],
    seed: int,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 64,
    architecture: str = "qwen2",
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    tie_word_embeddings: bool = True,
) -> Path:
    """Train a tokenizer on `texts`, initialise an `architecture` model (a key of
    TINY_ARCHITECTURES) from `seed` and save both at `path` (the LM head tied to the embedding, as in
    SmolLM2, unless `tie_word_embeddings` is off). `num_experts` and
    `num_experts_per_tok` apply to the MoE architectures only (module docstring).

    Returns `path`. The weights are written as safetensors with `save_pretrained`, so
    `load_causal_lm` and vLLM read them the same way as a downloaded checkpoint.
    """
    head_dim = hidden_size // num_heads
    if hidden_size % num_heads or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"hidden_size {hidden_size} / num_heads {num_heads} must give a head size in "
            f"{SUPPORTED_HEAD_DIMS} (vLLM's CPU attention refuses others)"
        )
    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is not one of {sorted(TINY_ARCHITECTURES)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    moe: dict[str, object] = {}
    if architecture in MOE_ARCHITECTURES:
        if not 1 <= num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok {num_experts_per_tok} must be in [1, num_experts {num_experts}]")
        moe = {
            "num_experts_per_tok": num_experts_per_tok,
            "moe_intermediate_size": intermediate_size // num_experts_per_tok,
            "norm_topk_prob": True,
        }
        if architecture == "deepseek_v3":
            moe |= {
                **_LATENT_ATTENTION,
                "head_dim": _LATENT_ATTENTION["qk_rope_head_dim"],  # DeepSeek's rotary width, as its config has it
                "num_key_value_heads": num_heads,  # keys and values from the latent for every head
                "tie_word_embeddings": False,
                "v_head_dim": head_dim,
                "n_routed_experts": num_experts,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
                "n_group": 1,
                "topk_group": 1,
                "topk_method": "noaux_tc",  # read by vLLM, which then loads the router's correction bias
                "scoring_func": "sigmoid",
                "routed_scaling_factor": 1.0,
                "rope_scaling": None,
            }
        else:
            moe |= {"num_experts": num_experts, "decoder_sparse_step": 1, "mlp_only_layers": []}
    path = Path(path)
    tokenizer = train_char_tokenizer(texts)
    tokenizer.model_max_length = max_position_embeddings
    shape = {
        "vocab_size": len(tokenizer),
        "head_dim": head_dim,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = TINY_ARCHITECTURES[architecture](**(shape | moe))
    # A private RNG stream: building a model must not move the caller's global torch seed.
    from transformers import AutoModelForCausalLM  # model code only where a model is built (models/__init__.py)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info("built tiny-%s at %s: %d parameters, vocab %d", architecture, path, num_params, len(tokenizer))
    return path
