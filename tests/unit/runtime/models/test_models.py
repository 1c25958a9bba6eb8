"""Tests of the tiny model builder, the loading code and the text<->tensor helpers."""

import pytest
import torch
from safetensors.torch import load_file

from rldock.config.data import GeneratorSpec
from rldock.config.job import ModelSpec
from rldock.runtime.data import Row, tokenizer_corpus
from rldock.runtime.data.addition import generate_addition
from rldock.runtime.models import (
    decode_responses,
    encode_answers,
    encode_prompts,
    ensure_model,
    load_causal_lm,
    load_tokenizer,
    max_token_length,
)
from rldock.runtime.models.tiny import build_tiny_model

TEXTS = tokenizer_corpus(
    [
        Row(r["prompt"], r["answer"], r["data_source"])
        for r in generate_addition(GeneratorSpec(name="addition", max_operand=99, num_prompts=50), seed=0).train
    ]
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), texts=TEXTS, seed=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def test_tokenizer_is_character_level_with_bos(tokenizer):
    ids = tokenizer("37+58=")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[1:]) == list("37+58=")
    assert len({tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}) == 3


def test_tokenizer_round_trip(tokenizer):
    for text in ["37+58=95", "0+0=0", "1234567890"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text


def test_encode_prompts_left_pads_and_masks(tokenizer):
    batch = encode_prompts(tokenizer, ["1+2=", "37+58="], max_length=8)
    assert batch.ids.shape == batch.mask.shape == (2, 8)
    assert batch.ids.dtype == torch.int64
    assert batch.mask.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert batch.ids[0, :3].tolist() == [tokenizer.pad_token_id] * 3
    assert batch.ids[0, 3].item() == tokenizer.bos_token_id
    # every prompt ends in the last column, right where generation continues
    assert tokenizer.decode(batch.ids[:, -1].tolist()) == "=="


def test_encode_prompts_refuses_a_prompt_longer_than_the_limit(tokenizer):
    with pytest.raises(ValueError, match="algorithm.max_prompt_length=6"):
        encode_prompts(tokenizer, ["37+58="], max_length=6)  # 7 tokens with BOS


def test_encode_answers_right_pads(tokenizer):
    batch = encode_answers(tokenizer, ["95", "7"], max_length=4)
    assert batch.mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0]]
    assert decode_responses(tokenizer, batch.ids, batch.mask) == ["95", "7"]
    with pytest.raises(ValueError, match="longer"):
        encode_answers(tokenizer, ["12345"], max_length=4)


def test_max_token_length(tokenizer):
    assert max_token_length(tokenizer, ["1+2=", "37+58="], add_special_tokens=True) == 7
    assert max_token_length(tokenizer, ["95", "197"], add_special_tokens=False) == 3


def test_decode_responses_stops_at_eos_and_drops_padding(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    digits = tokenizer("95", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([digits + [eos, digits[0], pad], digits + [pad, pad, pad]])  # (2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]])
    assert decode_responses(tokenizer, ids, mask) == ["95", "95"]


def test_saved_model_loads_through_the_real_loading_code(model_dir, tokenizer):
    model = load_causal_lm(model_dir, dtype="float32", device="cpu")
    config = model.config
    assert config.model_type == "qwen2"
    assert config.hidden_size // config.num_attention_heads in (32, 64, 80)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert (model_dir / "model.safetensors").exists()
    saved = load_file(str(model_dir / "model.safetensors"))
    for name, param in model.state_dict().items():
        if name in saved:
            assert torch.equal(param, saved[name]), name
    prompts = encode_prompts(tokenizer, ["37+58="], max_length=8)
    with torch.no_grad():
        logits = model(input_ids=prompts.ids, attention_mask=prompts.mask).logits  # (1, 8, V)
    assert logits.shape == (1, 8, len(tokenizer))


def test_load_causal_lm_dtype(model_dir):
    assert next(load_causal_lm(model_dir, dtype="bfloat16").parameters()).dtype == torch.bfloat16


def test_build_is_deterministic_given_the_seed(tmp_path, model_dir):
    again = build_tiny_model(tmp_path / "again", texts=TEXTS, seed=0)
    assert load_file(str(again / "model.safetensors")).keys() == load_file(str(model_dir / "model.safetensors")).keys()
    a, b = load_file(str(again / "model.safetensors")), load_file(str(model_dir / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_build_refuses_head_sizes_the_engines_reject(tmp_path):
    with pytest.raises(ValueError, match="head size"):
        build_tiny_model(tmp_path, texts=TEXTS, seed=0, hidden_size=64, num_heads=4)  # head_dim 16


def test_ensure_model_builds_once(tmp_path):
    spec = ModelSpec(path=str(tmp_path / "m"), builder="tiny-qwen2")
    assert ensure_model(spec, texts=TEXTS, seed=0) is True
    assert ensure_model(spec, texts=TEXTS, seed=0) is False


def test_ensure_model_without_builder_names_the_fields(tmp_path):
    with pytest.raises(ValueError, match="model.path.*model.builder"):
        ensure_model(ModelSpec(path=str(tmp_path / "empty")), texts=TEXTS, seed=0)
