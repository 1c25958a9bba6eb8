"""A pipeline stage loaded alone (models/loading.py's `load_causal_lm(stage=...)`, issue 61) is the stage
`cut_stage` makes of the whole loaded model (the cut training/pipeline.py's `split_stage` runs): the same
parameters and buffers (names, shapes, dtypes, values), the same record of the cut and the same outputs,
for a tied and an untied Qwen2 and a Qwen3-MoE of 5 layers at 2 and 3 stages (uneven: 3 + 2, 2 + 2 + 1).
And it reads only its own tensors from the safetensors file: the names and bytes read are the stage's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rldock.runtime.models import loading
from rldock.runtime.models.loading import load_causal_lm
from rldock.runtime.models.pipeline_stage import StageInput, StageNames, StageOutput, cut_stage, stage_cut
from rldock.runtime.models.tiny import build_tiny_model
from rldock.runtime.models.value import ValueModel, load_value_model

TEXTS = ["what is 12 + 7? 19", "hello world"]
KINDS = {"tied": ("qwen2", True), "untied": ("qwen2", False), "moe": ("qwen3_moe", True)}
STAGES = [(stage, stages) for stages in (2, 3) for stage in range(stages)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    return {
        kind: build_tiny_model(
            tmp_path_factory.mktemp(kind), texts=TEXTS, seed=0, num_layers=5, architecture=arch, tie_word_embeddings=tie
        )
        for kind, (arch, tie) in KINDS.items()
    }


class LinksDouble:
    """Stands in for a stage's StageLinks: hands the stage a fixed input and keeps what it emits."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden, self.emitted = hidden, []

    def receive(self, tokens: torch.Size) -> torch.Tensor:
        return self.hidden

    def emit(self, hidden: torch.Tensor) -> None:
        self.emitted.append(hidden)


def _whole_cut(path: Path, stage: int, stages: int):
    model = load_causal_lm(path)
    cut_stage(model, index=stage, size=stages)
    return model


def _assert_same_tensors(got: torch.nn.Module, want: torch.nn.Module) -> None:
    for named in ("named_parameters", "named_buffers"):
        mine, theirs = dict(getattr(got, named)()), dict(getattr(want, named)())
        assert mine.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert mine[name].dtype == tensor.dtype and mine[name].device == tensor.device, name
            assert mine[name].requires_grad == tensor.requires_grad, name
            assert torch.equal(mine[name], tensor), name


def _outputs(model: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stage's forward on fixed tokens (and, after the first stage, a fixed input): its logits (the
    activations it passes on, before the last stage) and what it emitted."""
    links = LinksDouble(hidden)
    for module in model.modules():
        if isinstance(module, StageInput | StageOutput):
            module.links = links  # type: ignore[assignment]  # a test double for StageLinks
    ids = torch.tensor([[1, 5, 6, 7, 8, 2], [1, 9, 10, 11, 12, 13]])  # (B, L)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits, links.emitted


@pytest.mark.parametrize("stage,stages", STAGES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_stage_loaded_alone_is_the_whole_model_cut(saved, kind, stage, stages):
    path = saved[kind]
    want, got = _whole_cut(path, stage, stages), load_causal_lm(path, stage=(stage, stages))
    assert type(got) is type(want) and got.training == want.training
    assert got.config.to_dict() == want.config.to_dict()
    assert got.generation_config.to_dict() == want.generation_config.to_dict()
    assert stage_cut(got) == stage_cut(want) is not None
    _assert_same_tensors(got, want)
    hidden = torch.randn(2, 6, want.config.hidden_size, generator=torch.Generator().manual_seed(stage))
    (got_out, got_emitted), (want_out, want_emitted) = _outputs(got, hidden), _outputs(want, hidden)
    assert torch.equal(got_out, want_out)
    assert len(got_emitted) == len(want_emitted) and all(map(torch.equal, got_emitted, want_emitted))


SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class ReadCounter:
    """Wraps safetensors' safe_open: records each tensor a loader takes from the file and its bytes."""

    def __init__(self) -> None:
        self.read: dict[str, int] = {}

    def __call__(self, *args, **kwargs):
        import safetensors

        counter, opened = self, safetensors.safe_open(*args, **kwargs)

        class Handle:
            def __enter__(self):
                self.inner = opened.__enter__()
                return self

            def __exit__(self, *exc):
                return opened.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_slice(self, name):
                sliced = self.inner.get_slice(name)
                element = SAFETENSORS_DTYPES[sliced.get_dtype()].itemsize
                counter.read[name] = element * torch.Size(sliced.get_shape()).numel()
                return sliced

        return Handle()


def _bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("stage,stages", STAGES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_stage_reads_only_its_own_tensors(saved, kind, stage, stages, monkeypatch):
    counter = ReadCounter()
    monkeypatch.setattr(loading, "safe_open", counter)
    model = load_causal_lm(saved[kind], stage=(stage, stages))
    cut = stage_cut(model)
    assert cut is not None
    layers = {int(name.split(".")[2]) for name in counter.read if name.startswith("model.layers.")}
    assert layers == set(cut.layers)
    assert ("model.embed_tokens.weight" in counter.read) == (stage == 0 or (cut.last and KINDS[kind][1]))
    assert ("model.norm.weight" in counter.read) == cut.last
    # what was read is the stage's parameters to the byte (a tied last stage's head: the embedding's tensor,
    # an MoE layer's experts: their per-expert tensors fused), and less than the whole model's
    assert sum(counter.read.values()) == _bytes(model) < _bytes(load_causal_lm(saved[kind]))


def _value_model_cut(path: Path, stage: int, stages: int) -> ValueModel:
    torch.manual_seed(0)
    lm = load_causal_lm(path)
    model = ValueModel(lm.base_model, lm.config.hidden_size)
    cut_stage(model, index=stage, size=stages)
    return model


@pytest.mark.parametrize("stage,stages", [(0, 2), (1, 2), (1, 3)])
def test_the_critic_s_value_model_stage_is_the_whole_one_cut(saved, stage, stages, monkeypatch):
    counter = ReadCounter()
    monkeypatch.setattr(loading, "safe_open", counter)
    got = load_value_model(saved["tied"], dtype="float32", device="cpu", stage=(stage, stages))
    want = _value_model_cut(saved["tied"], stage, stages)
    assert stage_cut(got) == stage_cut(want) and not stage_cut(got).tied  # type: ignore[union-attr]
    _assert_same_tensors(got, want)
    assert not any(name.startswith("lm_head") for name in counter.read)  # the LM head is never read
    assert sum(counter.read.values()) == _bytes(got) - _bytes(got.head)  # the value head is new, never read


def test_a_folder_without_safetensors_loads_whole_and_is_cut(saved, tmp_path):
    folder = tmp_path / "bin"
    shutil.copytree(saved["untied"], folder)
    (folder / "model.safetensors").unlink()
    torch.save(load_causal_lm(saved["untied"]).state_dict(), folder / "pytorch_model.bin")
    _assert_same_tensors(load_causal_lm(folder, stage=(1, 2)), _whole_cut(saved["untied"], 1, 2))


def test_stage_names_map_a_stage_s_layers_to_the_whole_model_s():
    names = StageNames(range(3, 5))
    assert names.local("model.layers.4.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert names.local("model.layers.2.mlp.up_proj.weight") is None
    assert names.whole("model.layers.1.mlp.up_proj.weight") == "model.layers.4.mlp.up_proj.weight"
