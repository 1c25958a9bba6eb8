"""The hand count (rldock_benchmarks.flop_count) against the product's count (runtime/driver/utilisation.py
with the passes' tallies) on a made-up model folder and equal lengths, where the means are exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rldock.runtime.driver.utilisation import forward_flops, rollout_flops, rollout_work, update_flops
from rldock.runtime.engines.packing import pass_work
from rldock.runtime.planning.shapes import shape_from_hf_config
from rldock_benchmarks.flop_count import compare, hand_count, weight_counts

CONFIG = {
    "num_hidden_layers": 2,
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "intermediate_size": 12,
    "vocab_size": 20,
    "tie_word_embeddings": True,
}
G, N, P, R = 3, 4, 5, 6


@pytest.fixture
def model_dir(tmp_path):
    h, kv, mlp = 8, 4, 12  # hidden, KV width (1 head of 4), MLP width
    weights = {"model.embed_tokens.weight": torch.zeros(20, h), "model.norm.weight": torch.zeros(h)}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        weights |= {
            prefix + "self_attn.q_proj.weight": torch.zeros(h, h),
            prefix + "self_attn.k_proj.weight": torch.zeros(kv, h),
            prefix + "self_attn.v_proj.weight": torch.zeros(kv, h),
            prefix + "self_attn.o_proj.weight": torch.zeros(h, h),
            prefix + "mlp.gate_proj.weight": torch.zeros(mlp, h),
            prefix + "mlp.up_proj.weight": torch.zeros(mlp, h),
            prefix + "mlp.down_proj.weight": torch.zeros(h, mlp),
            prefix + "input_layernorm.weight": torch.zeros(h),
        }
    save_file(weights, str(tmp_path / "model.safetensors"))
    return tmp_path


def packed_batch():
    """G groups of N rows: a P-token prompt (left-padded to P + 2) and R-token responses."""
    prompt_ids = torch.arange(G).repeat_interleave(N)[:, None].expand(G * N, P + 2) + 1  # (B, PL) a prompt per group
    prompt_mask = torch.ones(G * N, P + 2, dtype=torch.int64)
    prompt_mask[:, :2] = 0
    attention = torch.ones(G * N, R + 1, dtype=torch.int64)
    attention[:, R:] = 0
    return prompt_ids, prompt_mask, attention


def test_the_weights_come_from_the_safetensors(model_dir):
    assert weight_counts(model_dir) == {
        "layers": 2 * (2 * 64 + 2 * 32 + 3 * 96),
        "query_width": 8,
        "num_layers": 2,
        "embedding": 160,
    }


def test_the_hand_count_equals_the_products_count_at_equal_lengths(model_dir):
    shape = shape_from_hf_config(CONFIG, name="toy")
    hand = hand_count(
        weight_counts(model_dir),
        {"prompt_length_mean": P, "response_length_mean": R},
        num_prompts=G,
        num_responses=N,
    )
    assert hand["rollout"] == pytest.approx(rollout_flops(shape, rollout_work([P] * G, [R] * (G * N), group_size=N)))
    tokens, pairs = pass_work(*packed_batch(), packed=True)  # one packed pass over all groups
    assert tokens == G * P + G * N * R
    scored = G * N * R
    assert hand["update"] == pytest.approx(
        update_flops(shape, tokens=tokens, pairs=pairs, head_positions=scored, recompute=False)
    )
    assert hand["reference"] == pytest.approx(forward_flops(shape, tokens=tokens, pairs=pairs, head_positions=scored))
    # in rows each prompt is computed N times: more than the packed count
    row_tokens, row_pairs = pass_work(*packed_batch(), packed=False)
    assert (row_tokens, row_pairs) == (G * N * (P + R), G * N * (P + R) * (P + R + 1) // 2)


def test_compare_reads_a_run(model_dir, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    config = {
        "model": {"path": str(model_dir)},
        "algorithm": {"num_prompts_per_iteration": G, "num_responses_per_prompt": N},
        "training": {"data_parallel_size": 2},
    }
    (run / "config.json").write_text(json.dumps(config))
    hand = hand_count(
        weight_counts(model_dir),
        {"prompt_length_mean": P, "response_length_mean": R},
        num_prompts=G,
        num_responses=N,
    )
    record = {"iteration": 1, "prompt_length_mean": P, "response_length_mean": R, "flops/update": hand["update"]}
    (run / "metrics.jsonl").write_text(
        json.dumps({"iteration": 0, "val/reward": 0.5}) + "\n" + json.dumps(record) + "\n"
    )
    (row,) = compare(run)
    assert (row["stage"], row["ratio"]) == ("update", 1.0) and row["ratio_split"] < 1.0
