"""The plan of copies for a CPU engine's weight updates (engines/cpu_weight_reload.py), on a module tree laid out as
vLLM lays a dense decoder out: which checkpoint tensor goes where, what it refuses, and what a load leaves.

The layers here are stand-ins for vLLM's (the real ones, and the plan against vLLM's own reload, are in
tests/integration/test_architectures_in_vllm.py): a linear layer whose weight was dropped after "packing" keeps a
copy of what it was packed from, so a test can read what the plan's processing saw."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from rldock.runtime.engines.cpu_weight_reload import ReloadPlan

HIDDEN, HEADS_Q, HEADS_KV, VOCAB, PADDED_VOCAB = 4, 4, 2, 5, 8


class UnquantizedLinearMethod:  # the name the plan knows vLLM's CPU linear method by
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed = layer.weight.detach().clone()  # what vLLM's oneDNN handle would pack
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


class UnquantizedEmbeddingMethod:
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed = layer.weight.detach().clone()  # the tied head's packed copy; the weight stays


class FusedMoEMethod:
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass


class Linear(nn.Module):
    def __init__(self, rows: int, columns: int, *, bias: bool = False) -> None:
        super().__init__()
        self.output_size_per_partition, self.input_size_per_partition = rows, columns
        self.weight = nn.Parameter(torch.zeros(rows, columns), requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.zeros(rows), requires_grad=False)
        self.quant_method = UnquantizedLinearMethod()
        self.quant_method.process_weights_after_loading(self)


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(PADDED_VOCAB, HIDDEN), requires_grad=False)
        self.quant_method = UnquantizedEmbeddingMethod()
        self.quant_method.process_weights_after_loading(self)


class Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN), requires_grad=False)


class Decoder(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = Embedding()
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = Linear(HEADS_Q + 2 * HEADS_KV, HIDDEN, bias=True)
        layer.self_attn.o_proj = Linear(HIDDEN, HEADS_Q)
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = Linear(2 * 6, HIDDEN)
        layer.mlp.down_proj = Linear(HIDDEN, 6)
        layer.input_layernorm = Norm()
        self.model.layers = nn.ModuleList([layer])
        self.model.norm = Norm()
        self.lm_head = Embedding()
        self.lm_head.weight = self.model.embed_tokens.weight  # tied, as vLLM ties them


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint of the decoder above, random values."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": (HEADS_Q, HIDDEN),
        "model.layers.0.self_attn.q_proj.bias": (HEADS_Q,),
        "model.layers.0.self_attn.k_proj.weight": (HEADS_KV, HIDDEN),
        "model.layers.0.self_attn.k_proj.bias": (HEADS_KV,),
        "model.layers.0.self_attn.v_proj.weight": (HEADS_KV, HIDDEN),
        "model.layers.0.self_attn.v_proj.bias": (HEADS_KV,),
        "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS_Q),
        "model.layers.0.mlp.gate_proj.weight": (6, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": (6, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": (HIDDEN, 6),
        "model.layers.0.input_layernorm.weight": (HIDDEN,),
        "model.norm.weight": (HIDDEN,),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def shapes_of(weights: dict[str, torch.Tensor]) -> list[tuple[str, torch.Size]]:
    return [(name, tensor.shape) for name, tensor in weights.items()]


def test_a_load_puts_every_tensor_in_its_place_and_packs_each_layer_again():
    model, weights = Decoder(), checkpoint()
    plan = ReloadPlan.of(model, shapes_of(weights))
    assert isinstance(plan, ReloadPlan), plan
    plan.load(weights.items())
    layer = model.model.layers[0]
    # fused layers: the checkpoint's parts stacked in packed_modules_mapping's order, then packed
    q, k, v = (weights[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(layer.self_attn.qkv_proj.packed, torch.cat([q, k, v]))
    assert torch.equal(
        layer.self_attn.qkv_proj.bias, torch.cat([weights[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    )
    gate, up = weights["model.layers.0.mlp.gate_proj.weight"], weights["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(layer.mlp.gate_up_proj.packed, torch.cat([gate, up]))
    assert torch.equal(layer.mlp.down_proj.packed, weights["model.layers.0.mlp.down_proj.weight"])
    assert layer.mlp.down_proj.weight.numel() == 0  # dropped again after packing, as vLLM drops it
    # the vocabulary's padding rows stay as they were; the tied head is packed from the new embedding
    embedding = model.model.embed_tokens.weight
    assert torch.equal(embedding[:VOCAB], weights["model.embed_tokens.weight"]) and not embedding[VOCAB:].any()
    assert torch.equal(model.lm_head.packed, embedding)
    assert torch.equal(model.model.norm.weight, weights["model.norm.weight"])
    # the next version: every place written anew
    again = checkpoint(seed=1)
    plan.load(again.items())
    assert torch.equal(layer.mlp.down_proj.packed, again["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(model.lm_head.packed[:VOCAB], again["model.embed_tokens.weight"])


def test_what_the_plan_does_not_know_gives_no_plan_and_names_it():
    weights = checkpoint()

    def refusal(model: nn.Module, shapes: list[tuple[str, torch.Size]]) -> str:
        plan = ReloadPlan.of(model, shapes)
        assert isinstance(plan, str)
        return plan

    shapes = shapes_of(weights)
    unknown = [*shapes, ("model.layers.0.mlp.experts.0.w1.weight", torch.Size([6, HIDDEN]))]
    assert "has no layer model.layers.0.mlp.experts.0.w1" in refusal(Decoder(), unknown)
    no_v = [(n, s) for n, s in shapes if "v_proj" not in n]
    assert refusal(Decoder(), no_v).endswith("the checkpoint holds 2 of its 3 parts")
    no_norm = [(n, s) for n, s in shapes if n != "model.norm.weight"]
    assert refusal(Decoder(), no_norm) == "no checkpoint tensor writes model.norm.weight"
    narrow = [(n, torch.Size([s[0], 3]) if n.endswith("o_proj.weight") else s) for n, s in shapes]
    assert "do not make its weight" in refusal(Decoder(), narrow)
    short_norm = [(n, torch.Size([2]) if n == "model.norm.weight" else s) for n, s in shapes]
    assert "does not fit model.norm.weight" in refusal(Decoder(), short_norm)
    assert refusal(Decoder(), [*shapes, ("scale", torch.Size([]))]) == "scale is a scalar"
    moe = Decoder()
    moe.model.layers[0].mlp.down_proj.quant_method = FusedMoEMethod()
    assert "with FusedMoEMethod, whose weights this plan does not process" in refusal(moe, shapes)


def test_a_push_of_other_names_than_the_plans_is_refused():
    weights = checkpoint()
    plan = ReloadPlan.of(Decoder(), shapes_of(weights))
    assert isinstance(plan, ReloadPlan)
    items = list(weights.items())
    for pushed, says in [
        ([*items, ("model.extra.weight", torch.zeros(1))], "no name the plan was built for"),
        ([*items, items[0]], "pushed twice"),
        (items[1:], "missing ['model.embed_tokens.weight']"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            plan.load(pushed)
