"""Tests of the supervised warm-up."""

import pytest
import torch

from rldock.config.job import DataSpec, GeneratorSpec, WarmupSpec
from rldock.runtime.data import PromptDataset, Row, tokenizer_corpus
from rldock.runtime.data.addition import generate_addition
from rldock.runtime.models import build_tiny_model, load_causal_lm, load_tokenizer
from rldock.runtime.models.loading import TokenBatch
from rldock.runtime.warmup import answer_loss, run_warmup

ROWS = [
    Row(r["prompt"], r["answer"], r["data_source"])
    for r in generate_addition(GeneratorSpec(name="addition", max_operand=5, num_prompts=100), seed=0).train
]


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matmuls gain nothing from threads, and on a shared 2-core machine oversubscribed
    # threads made this test 15x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("base"), texts=tokenizer_corpus(ROWS), seed=0)


@pytest.fixture(scope="module")
def dataset(base_dir):
    return PromptDataset(
        ROWS, tokenizer=load_tokenizer(base_dir), spec=DataSpec(chat_template="none"), max_prompt_length=8
    )


def test_warmup_reduces_loss_and_saves_a_loadable_model(base_dir, dataset, tmp_path):
    spec = WarmupSpec(steps=20, learning_rate=1e-3, batch_size=32)
    metrics = run_warmup(base_dir, tmp_path / "warm", dataset=dataset, spec=spec, seed=0)
    losses = metrics["loss"]
    assert len(losses) == metrics["steps"] == 20
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    assert metrics["seconds"] > 0
    assert load_tokenizer(tmp_path / "warm").get_vocab() == load_tokenizer(base_dir).get_vocab()
    warm, base = load_causal_lm(tmp_path / "warm"), load_causal_lm(base_dir)
    assert not all(torch.equal(a, b) for a, b in zip(warm.parameters(), base.parameters()))


def test_warmup_is_deterministic_given_the_seed(base_dir, dataset, tmp_path):
    spec = WarmupSpec(steps=3, learning_rate=1e-3, batch_size=8)
    first = run_warmup(base_dir, tmp_path / "a", dataset=dataset, spec=spec, seed=5)["loss"]
    second = run_warmup(base_dir, tmp_path / "b", dataset=dataset, spec=spec, seed=5)["loss"]
    assert first == second


def test_zero_steps_copies_the_model(base_dir, dataset, tmp_path):
    metrics = run_warmup(base_dir, tmp_path / "same", dataset=dataset, spec=WarmupSpec(steps=0), seed=0)
    assert metrics["loss"] == []
    for a, b in zip(load_causal_lm(tmp_path / "same").parameters(), load_causal_lm(base_dir).parameters()):
        assert torch.equal(a, b)


def test_answer_loss_ignores_padding_columns(base_dir):
    model, tokenizer = load_causal_lm(base_dir), load_tokenizer(base_dir)
    prompt_ids = torch.tensor([tokenizer("3+4=")["input_ids"]])  # (1, 5)
    prompts = TokenBatch(prompt_ids, torch.ones_like(prompt_ids))
    target = tokenizer("7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    tight = TokenBatch(torch.tensor([target]), torch.ones(1, 2, dtype=torch.int64))
    padded = TokenBatch(torch.tensor([target + [tokenizer.pad_token_id] * 2]), torch.tensor([[1, 1, 0, 0]]))
    with torch.no_grad():
        assert answer_loss(model, prompts, tight).item() == pytest.approx(
            answer_loss(model, prompts, padded).item(), abs=1e-6
        )
