"""The unit tests' one tiny causal LM (imported by basename, like tests/jobs.py: tests/conftest.py's
folder is on sys.path in pytest's prepend import mode)."""

from __future__ import annotations


def tiny_qwen2(
    *,
    vocab_size: int = 32,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 1,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    max_position_embeddings: int = 32,
    **config,
):
    """A randomly initialised `Qwen2ForCausalLM(Qwen2Config(...))`, small enough to run forward and
    backward on a CPU in milliseconds, with the parts a real Qwen2 has: grouped-query attention
    (two query heads share one key/value head by default, so the KV repeat runs), rotary positions
    on a head_dim of hidden_size / num_attention_heads = 16 (even, as rotary needs), a gated MLP of
    twice the width, and a vocabulary of 32 ids so that a (tokens, vocab) logits tensor stays tiny.
    max_position_embeddings 32 covers the tests' prompt plus response lengths. Any other config
    field (attn_implementation, initializer_range, tie_word_embeddings, ...) passes through
    `config`.

    The weights come from torch's global RNG and nothing here seeds it: a test that needs the same
    weights twice calls torch.manual_seed itself before this, and .eval(), .double() and the like
    stay at the call site too."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=num_attention_heads,
            num_key_value_heads=num_key_value_heads,
            max_position_embeddings=max_position_embeddings,
            **config,
        )
    )
