"""A tiny model for the twin tests (the `npu_twin` fixture itself is in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldock.runtime.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def twin_model_dir(tmp_path_factory) -> Path:
    texts = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    return build_tiny_model(
        tmp_path_factory.mktemp("twin-tiny"),
        texts=texts,
        seed=0,
        hidden_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
    )
