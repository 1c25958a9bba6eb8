"""The tiny Qwen3-MoE builder and loader, the routing record, the router's auxiliary loss against
Hugging Face's own (whole, and from the totals of parts of the layers, as pipeline stages add them) and the
expert-load metrics."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from rldock.runtime.models import MODEL_BUILDERS, load_causal_lm
from rldock.runtime.models.moe import (
    RouterRecord,
    RouterTotals,
    balance_loss,
    expert_load,
    expert_load_metrics,
    load_balancing_loss,
    moe_shape,
    record_routing,
    router_totals,
    routers,
    totals_width,
)
from rldock.runtime.models.router_loss import RouterLoss

TEXTS = ["12+7=19", "40-2=38 #### 38"]


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe"
    MODEL_BUILDERS.get("tiny-qwen3-moe")(path, texts=TEXTS, seed=0)
    return path


def test_builder_writes_a_hub_layout_qwen3_moe_that_the_loader_reads(tiny_moe):
    config = json.loads((tiny_moe / "config.json").read_text())
    # transformers 5 writes Qwen3-MoE's num_experts under its alias num_local_experts
    assert (
        config["model_type"] == "qwen3_moe" and config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    )
    with safe_open(str(tiny_moe / "model.safetensors"), "pt") as f:  # one tensor per expert, as on the Hub
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in f.keys()
    model = load_causal_lm(tiny_moe)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert len(routers(model)) == 2
    assert moe_shape(model.config).router_aux_loss_coef == pytest.approx(0.001)


def _recorded_pass(path):
    """The tiny MoE, the record of a pass over 3 rows (one left-padded) and Hugging Face's own aux loss of it."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load_causal_lm(path)
    ids = torch.randint(4, model.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # a left-padded row
    with record_routing(model) as record:
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    return model, record, load_balancing_loss_func(out.router_logits, 4, 2, mask)


def test_recorded_routing_and_aux_loss_equal_hugging_faces(tiny_moe):
    model, record, expected = _recorded_pass(tiny_moe)
    assert record.num_layers == 2 and record.indices[0][0].shape == (30, 2)
    got = load_balancing_loss(record, num_experts=4, top_k=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    got.backward()  # trains the routers
    assert all(gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0 for gate in routers(model))


def test_the_totals_of_runs_of_layers_add_up_to_the_whole_model_s_loss(tiny_moe):
    """A pipeline stage's totals hold its layers' rows of the whole grid; the stages' totals added (through
    `flat`, as they travel) give Hugging Face's loss over every layer, and its gradient reaches each run's
    routers. Taking each run's loss alone and adding them would not: the loss is a product of sums."""
    model, record, expected = _recorded_pass(tiny_moe)

    def run(layer: int) -> RouterRecord:  # the record a stage holding only `layer` makes
        return RouterRecord(
            logits=[[record.logits[0][layer]]], indices=[[record.indices[0][layer]]], masks=record.masks
        )

    parts = [router_totals(run(layer), num_experts=4, top_k=2, first_router=layer, num_routers=2) for layer in (0, 1)]
    assert parts[0].counts[1].sum() == 0 and parts[1].counts[0].sum() == 0  # each stage's own row of the grid
    flat = parts[0].flat() + parts[1].flat()
    assert flat.shape == (totals_width(num_routers=2, num_experts=4),)
    totals = RouterTotals.from_flat(flat, num_routers=2, num_experts=4)
    assert float(totals.rows.detach()) == 2 * 26  # 26 real tokens in each layer's rows
    got = balance_loss(totals)
    # the same sums as the whole record's (each row of the grid from one part, the probabilities in layer order)
    assert torch.equal(got, load_balancing_loss(record, num_experts=4, top_k=2))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(totals.counts, (parts[0] + parts[1]).counts)
    separate = balance_loss(parts[0]) + balance_loss(parts[1])  # each run's loss alone, added: not the loss
    assert abs(float((separate - expected).detach())) > 1e-3
    got.backward()
    assert all(gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0 for gate in routers(model))


def test_expert_load_metrics():
    # 4 real tokens, top-2 of 4 experts, one layer: expert 0 takes 4 of the 8 assignments; the padded
    # token's choice (expert 3) is not counted.
    indices = torch.tensor([[0, 1], [0, 2], [0, 1], [0, 2], [3, 3]])
    record = RouterRecord(logits=[[torch.zeros(5, 4)]], indices=[[indices]], masks=[torch.tensor([1.0, 1, 1, 1, 0])])
    load = expert_load(router_totals(record, num_experts=4, top_k=2))
    torch.testing.assert_close(load, torch.tensor([[0.5, 0.25, 0.25, 0.0]]))
    metrics = expert_load_metrics(load)
    assert metrics["moe/expert_load_max"] == 2.0 and metrics["moe/expert_load_min"] == 0.0
    assert metrics["moe/layer0/expert_load_max"] == 2.0


@pytest.mark.parametrize(("coef", "expected"), [(None, 0.001), (0.5, 0.5), (0.0, 0.0)])
def test_router_loss_adds_the_weighted_aux_loss(tiny_moe, coef, expected):
    model = load_causal_lm(tiny_moe)
    router = RouterLoss(model, coef=coef)
    assert router.coef == pytest.approx(expected)
    ids = torch.randint(4, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with router.recording(model) as record:
        model(input_ids=ids)
    base = torch.tensor(1.0)
    loss, metrics = router.add(base, {"pg_loss": 1.0}, record, share=0.5)
    aux = metrics["moe/aux_loss"] / 0.5
    assert aux > 0
    assert float(loss) == pytest.approx(1.0 + expected * 0.5 * aux, rel=1e-6)
    assert metrics["pg_loss"] == 1.0 and metrics["moe/expert_load_max"] >= 0.5


def test_router_loss_leaves_a_dense_model_alone(tmp_path):
    path = MODEL_BUILDERS.get("tiny-qwen3")(tmp_path / "dense", texts=TEXTS, seed=0)
    model = load_causal_lm(path)
    router = RouterLoss(model, coef=0.5)
    with router.recording(model) as record:
        model(input_ids=torch.tensor([[4, 5, 6]]))
    loss, metrics = router.add(torch.tensor(2.0), {"a": 1.0}, record, share=1.0)
    assert record is None and float(loss) == 2.0 and metrics == {"a": 1.0}


def test_unfused_experts_are_the_hub_checkpoints_tensors(tiny_moe):
    """What the engine is pushed after an update: the per-expert tensors save_pretrained wrote."""
    from safetensors.torch import load_file

    from rldock.runtime.models.moe import unfuse_experts

    model = load_causal_lm(tiny_moe)
    pushed = dict(unfuse_experts(model.state_dict().items(), model_type="qwen3_moe"))
    on_disk = load_file(str(tiny_moe / "model.safetensors"))
    assert pushed.keys() - {"lm_head.weight"} == on_disk.keys() - {"lm_head.weight"}
    for name, tensor in on_disk.items():
        assert torch.equal(pushed[name], tensor), name


def test_unfused_mixtral_experts_are_its_checkpoints_tensors(tmp_path):
    """Mixtral's checkpoint names its sparse block `block_sparse_moe` and its experts w1, w3 (gate, up), w2."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM

    from rldock.runtime.models.moe import unfuse_experts

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = MixtralForCausalLM(config)
    assert len(routers(model)) == 2 and moe_shape(model.config).num_experts == 4
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    pushed = dict(unfuse_experts(model.state_dict().items(), model_type="mixtral"))
    assert pushed.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(pushed[name], tensor), name


def test_a_dense_models_weights_pass_through():
    from rldock.runtime.models.moe import unfuse_experts

    weights = [("model.layers.0.mlp.gate_proj.weight", torch.zeros(2, 2))]
    assert list(unfuse_experts(weights, model_type="qwen2")) == weights
