"""The npu twin for the tests in this folder: built once per machine into the cache (about 30 s of
CPU time cold, see rldock_e2e.doubles.npu_twin.build), installed once per test process.

Installing it registers `torch.npu` for the rest of the process; `resources.device: auto` still
resolves to the CPU (the twin answers only an explicit `npu`), so later tests are unaffected.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rldock.runtime.models.tiny import build_tiny_model


@pytest.fixture(scope="session")
def npu_twin():
    """`torch.npu`, the twin's; skips with the reason only where no compiler can build it."""
    from rldock_e2e.doubles.npu_twin import TwinUnavailable, activate

    try:
        activate()
    except TwinUnavailable as error:
        pytest.skip(str(error))
    import torch

    return torch.npu


@pytest.fixture(scope="session")
def twin_model_dir(tmp_path_factory) -> Path:
    texts = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    return build_tiny_model(tmp_path_factory.mktemp("twin-tiny"), texts=texts, seed=0, hidden_size=64,
                            num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=128)
