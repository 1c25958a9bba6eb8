"""The trainer's `mfu/` inputs: found from the model's config.json and actor rank 0's measurement, and
left off, with a warning, where either cannot give them (a metric never stops a job)."""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import pytest
import yaml

from rldock.config import parse_job_config
from rldock.runtime.driver import utilisation as utilisation_module
from rldock.runtime.driver.utilisation import UtilisationInputs, measure_utilisation_inputs

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
LLAMA_CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 16,
    "vocab_size": 10,
}
GPT2_CONFIG = {"n_layer": 2, "n_embd": 8, "n_head": 2, "vocab_size": 10}  # what preflight accepts too
MEASURED = {"device_kind": "cpu", "measured": {"float32": {"peak_flops": 1e11, "bandwidth": 1e10}}}


def _measure(tmp_path, monkeypatch, config: dict, found: dict) -> UtilisationInputs | None:
    """The inputs from the demo's config, the reference's config.json `config` and actor rank 0,
    whose `device_rates` answers `found` (no Ray: ray.get hands it through)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    actor = types.SimpleNamespace(device_rates=types.SimpleNamespace(remote=lambda dtypes: found))
    cfg = parse_job_config(yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text()))
    monkeypatch.setattr(utilisation_module.ray, "get", lambda value: value)
    return measure_utilisation_inputs(cfg, tmp_path, actor)


def test_a_llama_style_config_and_a_measurement_give_the_inputs(tmp_path, monkeypatch):
    inputs = _measure(tmp_path, monkeypatch, LLAMA_CONFIG, MEASURED)
    assert inputs is not None and inputs.shape.num_layers == 2
    assert inputs.rates.peak_flops == {"float32": 1e11} and inputs.rates.shared


@pytest.mark.parametrize(
    ("config", "found", "why"),
    [
        (GPT2_CONFIG, MEASURED, "num_attention_heads"),
        (LLAMA_CONFIG, {"device_kind": "npu", "unavailable": "PeakUnavailable: no get_device_name"}, "peak"),
        (LLAMA_CONFIG, {"device_kind": "cuda", "unavailable": "OutOfMemoryError: CUDA out of memory"}, "memory"),
    ],
)
def test_a_count_that_cannot_be_made_leaves_the_metrics_off_with_a_warning(
    tmp_path, monkeypatch, caplog, config, found, why
):
    with caplog.at_level(logging.WARNING, logger=utilisation_module.__name__):
        assert _measure(tmp_path, monkeypatch, config, found) is None
    (warning,) = caplog.records
    assert warning.getMessage().startswith("no mfu/ metrics") and why in warning.getMessage()
