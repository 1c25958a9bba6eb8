"""The tiny builders for each architecture users bring (Llama, Qwen2, Qwen3), the tokenizer's pad
fallback, and the tensor-parallel plan's architecture check."""

import logging
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from rldock.config.job import ModelSpec
from rldock.contract.tensor_parallel import check_architecture
from rldock.runtime.models import MODEL_BUILDERS, ensure_model, load_causal_lm, load_tokenizer
from rldock.runtime.models.tiny import build_tiny_model, train_char_tokenizer

TEXTS = ["Sam has 3 apples and buys 5 more. #### 8", "12+7=19"]


@pytest.mark.parametrize(
    "builder, model_type",
    [("tiny-qwen2", "qwen2"), ("tiny-llama", "llama"), ("tiny-qwen3", "qwen3"), ("tiny-qwen3-moe", "qwen3_moe")],
)
def test_each_builder_saves_a_model_the_loader_reads(tmp_path, builder, model_type):
    assert ensure_model(ModelSpec(path=str(tmp_path), builder=builder), texts=TEXTS, seed=0)
    model = load_causal_lm(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    assert model.config.model_type == model_type
    assert model.config.head_dim == 32  # vLLM's CPU attention refuses 16; Qwen3 would default to 128
    assert model.config.vocab_size == len(tokenizer)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied, as in SmolLM2
    ids = torch.tensor([tokenizer("12+7=")["input_ids"]])
    logits = model(input_ids=ids).logits  # (1, L, V)
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_architectures_differ_from_the_same_seed(tmp_path):
    llama = MODEL_BUILDERS.get("tiny-llama")(tmp_path / "llama", texts=TEXTS, seed=0)
    qwen3 = MODEL_BUILDERS.get("tiny-qwen3")(tmp_path / "qwen3", texts=TEXTS, seed=0)
    names = {name for name, _ in load_causal_lm(qwen3).named_parameters()}
    assert any("q_norm" in name for name in names)  # Qwen3's per-head norms exist, Llama has none
    assert not any("q_norm" in name for name, _ in load_causal_lm(llama).named_parameters())


def test_unknown_architecture_is_refused(tmp_path):
    with pytest.raises(ValueError, match="architecture 'gpt2' is not one of"):
        build_tiny_model(tmp_path, texts=TEXTS, seed=0, architecture="gpt2")


def test_missing_pad_falls_back_to_eos_with_a_log_line(tmp_path, caplog):
    tokenizer = train_char_tokenizer(TEXTS)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    assert PreTrainedTokenizerFast.from_pretrained(str(tmp_path)).pad_token_id is None  # the case is real
    with caplog.at_level(logging.INFO, logger="rldock.runtime.models.loading"):
        loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id
    assert "no pad token; padding with eos" in caplog.text


def test_missing_eos_is_an_error_naming_the_file(tmp_path):
    tokenizer = train_char_tokenizer(TEXTS)
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="defines no eos token; set eos_token in its tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_tp_plan_covers_llama_qwen2_qwen3_only():
    for model_type in ("llama", "qwen2", "qwen3"):
        check_architecture(tp_size=2, model_type=model_type, field="training.tensor_parallel_size")
    check_architecture(tp_size=1, model_type="gpt2", field="training.tensor_parallel_size")  # TP 1: no plan needed
    with pytest.raises(ValueError, match=r"training.tensor_parallel_size=2 .*model_type 'gpt2'"):
        check_architecture(tp_size=2, model_type="gpt2", field="training.tensor_parallel_size")


@pytest.mark.parametrize(("builder", "model_type"), [("tiny-llama", "llama"), ("tiny-qwen3-moe", "qwen3_moe")])
def test_a_job_builds_the_model_its_builder_names(tmp_path, builder, model_type):
    """`rldock train` builds model.builder's architecture (it built tiny-qwen2 whatever the builder said)."""
    import json

    import yaml

    from rldock.config import parse_job_config
    from rldock.runtime.data.rows import Row
    from rldock.runtime.driver.inputs import prepare_base_model

    data = yaml.safe_load((Path(__file__).resolve().parents[4] / "examples" / "grpo-tiny.yaml").read_text())
    data["model"] = {"path": str(tmp_path / "model"), "builder": builder}
    rows = [Row(prompt="12+7=", ground_truth="19", data_source="addition")]
    base = prepare_base_model(parse_job_config(data), rows)
    assert json.loads((base / "config.json").read_text())["model_type"] == model_type
