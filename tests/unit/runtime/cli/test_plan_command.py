"""`rldock plan`: the table or JSON, exit 0 when the job fits, 3 when refused (naming the field),
2 when the model's shape cannot be found."""

import json
from pathlib import Path

import pytest

from rldock.runtime.cli import main
from rldock.runtime.cli.arguments import parse_memory

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
PAPER_7B = str(EXAMPLES / "grpo-qwen2.5-7b-paper.yaml")


def test_paper_7b_fits_64gib_and_prints_both_phases(capsys):
    assert main(["plan", PAPER_7B, "--model-preset", "qwen2.5-7b", "--device-memory", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "Qwen2.5-7B: 7.62B parameters, fsdp, DP 16" in out and "update" in out and "generation" in out
    assert out.strip().splitlines()[-1].startswith("OK fits")


def test_refusal_exits_3_and_names_the_field(capsys):
    code = main(
        [
            "plan",
            PAPER_7B,
            "--model-preset",
            "qwen2.5-7b",
            "--device-memory",
            "120GiB",  # DDP's update holds 121.2 GiB
            "--json",
            "--set",
            "training.strategy=ddp",
            "--set",
            "training.mixed_precision=none",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 3 and report["fits"] is False and report["field"] == "training.strategy"
    assert report["update"]["device_total"] > 120 * 1024**3


def test_device_memory_comes_from_the_config_when_not_given(capsys):
    assert main(["plan", PAPER_7B, "--model-preset", "qwen2.5-7b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_memory"] == 64 * 1024**3


def test_missing_model_config_names_model_path(capsys):
    assert main(["plan", PAPER_7B]) == 2
    assert "model.path" in capsys.readouterr().err


def test_hf_config_json_gives_the_shape(tmp_path, capsys):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "vocab_size": 1000,
                "hidden_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 128,
                "tie_word_embeddings": True,
            }
        )
    )
    assert main(["plan", PAPER_7B, "--set", f"model.path={tmp_path}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["num_params"]
        == 1000 * 64 + 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 + 2 * 32 + 3 * 64 * 128 + 128) + 64
    )


@pytest.mark.parametrize(
    "text,expected",
    [
        ("64GiB", 64 * 1024**3),
        ("80GB", 80 * 10**9),
        ("512MiB", 512 * 1024**2),
        ("1TiB", 1024**4),
        ("64", 64 * 1024**3),
        ("64 gib", 64 * 1024**3),
        ("0.5", 1024**3 // 2),  # no unit: GiB
    ],
)
def test_memory_sizes(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize(
    "text, says",
    [
        ("64XB", "unknown unit 'XB'"),
        ("64B", "unknown unit 'B'"),
        ("GiB", "expects a size like 64 (GiB)"),
        ("-1GiB", "expects a size like 64 (GiB)"),
        ("0GiB", "above 0"),
    ],
)
def test_bad_memory_sizes_are_refused_naming_the_flag_and_the_units(text, says, capsys):
    with pytest.raises(SystemExit):
        main(["plan", PAPER_7B, f"--device-memory={text}"])
    err = capsys.readouterr().err
    assert "argument --device-memory" in err and says in err
    if "unit" in says:
        assert "units: GiB (the default), GB, TiB, TB, MiB, MB" in err


def test_a_bare_number_plans_for_that_many_gib(capsys):
    assert main(["plan", PAPER_7B, "--model-preset", "qwen2.5-7b", "--device-memory", "80", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["device_memory"] == 80 * 1024**3 and report["fits"] is True
