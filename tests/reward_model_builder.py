"""A tiny sequence-classification reward model for the unit and integration tests (imported by
basename: tests/conftest.py's folder is on sys.path in pytest's prepend import mode)."""

from __future__ import annotations


def build_tiny_reward_model(path, *, texts, num_labels: int = 1, constant: float | None = None, seed: int = 0):
    """Save a tiny Qwen2ForSequenceClassification (no pad id in its config, as many are) and a
    char tokenizer trained on `texts` at `path`. With `constant`, its weights are set so that it
    scores every text exactly that: every token embeds to the same vector, the layers add nothing
    (zero output projections), so the final hidden state is that vector's RMS norm, all ones, and
    the score head's weights are constant / hidden_size."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from rldock.runtime.models.tiny import train_char_tokenizer

    tokenizer = train_char_tokenizer(texts)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        num_labels=num_labels,
        rms_norm_eps=1e-12,
    )
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    if constant is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight.fill_(1.0)
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.score.weight.fill_(constant / config.hidden_size)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
