"""LoRA on the actor's policy: only adapters train, the merged weights equal peft's own merge while
the model keeps its adapters, and the base model (the reference) is the model with adapters off."""

import copy

import pytest
import torch

from rldock.config.training import LoraSpec
from rldock.runtime.models import load_causal_lm
from rldock.runtime.models.lora import adapters_off, add_lora, merged_weights
from rldock.runtime.models.tiny import build_tiny_model

TEXTS = ["Sam has 3 apples and buys 5 more. #### 8", "12+7=19"]
IDS = torch.tensor([[1, 5, 9, 3, 7, 2]])  # (1, L)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), texts=TEXTS, seed=0)


def _with_trained_adapters(base_dir, spec: LoraSpec):
    """A LoRA model whose adapters moved off their initial B = 0 (one optimizer step)."""
    model = add_lora(load_causal_lm(base_dir), spec)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    return model


def test_only_adapter_parameters_train_and_the_base_is_the_reference(base_dir):
    base = load_causal_lm(base_dir)
    model = _with_trained_adapters(base_dir, LoraSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable)
    assert all("q_proj" in name or "v_proj" in name for name in trainable)
    with torch.no_grad():
        reference = base(input_ids=IDS).logits
        assert not torch.allclose(model(input_ids=IDS).logits, reference, atol=1e-5)  # the adapters moved it
        with adapters_off(model):
            assert torch.allclose(model(input_ids=IDS).logits, reference, atol=1e-6)


def test_merged_weights_match_peft_merge_and_leave_the_adapters_in_place(base_dir):
    model = _with_trained_adapters(base_dir, LoraSpec(rank=4, alpha=16))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    merged = dict(merged_weights(model))
    expected = copy.deepcopy(model).merge_and_unload().state_dict()
    assert merged.keys() == expected.keys()  # plain HF names, as the engine's loader wants them
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    plain = load_causal_lm(base_dir)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=1e-5)


def test_target_modules_that_match_nothing_name_the_field(base_dir):
    with pytest.raises(ValueError, match=r"training.lora.target_modules \['qkv'\] names no Linear module"):
        add_lora(load_causal_lm(base_dir), LoraSpec(target_modules=["qkv"]))


def test_saved_adapters_load_back_trainable(base_dir, tmp_path):
    model = _with_trained_adapters(base_dir, LoraSpec(rank=2))
    model.save_pretrained(tmp_path / "adapter")
    loaded = add_lora(load_causal_lm(base_dir), LoraSpec(rank=2), adapter_dir=tmp_path / "adapter")
    assert any(p.requires_grad for p in loaded.parameters())
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits, rtol=0, atol=1e-6)
