"""The command line reports config problems with the field path and exit code 2."""

from pathlib import Path

from rldock.runtime.cli import main

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "grpo-tiny.yaml"


def test_validate_prints_the_resolved_config(capsys):
    assert main(["validate", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert "num_prompts_per_iteration: 16" in out and "timeout_s:" in out  # defaults filled in


def test_invalid_override_names_the_field(capsys):
    assert main(["validate", str(EXAMPLE), "--set", "training.data_parallel_size=3"]) == 2
    assert "training.data_parallel_size:" in capsys.readouterr().err


def test_unknown_field_override(capsys):
    assert main(["validate", str(EXAMPLE), "--set", "algorithm.lr=0.1"]) == 2
    assert "algorithm.lr: unknown field" in capsys.readouterr().err


def test_train_refuses_a_missing_model_before_starting_anything(tmp_path, capsys):
    config = tmp_path / "job.yaml"
    config.write_text(EXAMPLE.read_text().replace("  builder: tiny-qwen2", "").replace(
        "~/.cache/rldock/models/tiny-qwen2-addition-v1", str(tmp_path / "absent")))
    assert main(["train", str(config), "--output", str(tmp_path / "out")]) == 2
    assert "model.path: no model at" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
