"""`training.mode: async` end to end, kept short (3 iterations of a tiny model): with
dock.max_staleness 1 the pipeline runs one iteration ahead, so from iteration 2 on every sample the
update trains on was generated one policy version back; with 0 it never runs ahead and every sample
is on-policy. Either way nothing is dropped as stale and each iteration trains on all G*N samples.

The pipeline on sharded ranks: the staleness-1 job runs the tiny MoE (4 experts, 2 per token) at DP 2,
once on DDP ranks and once on FSDP x EP 2 ranks with allgather_swap (the shards swapped to the host while
generating; after every update the shards all-gathered and the experts gathered over the EP group into
the engine), both at generation TP 2: one vLLM engine of TP 2 on rank 0 generates for both ranks, rank 1
holds none. Each actor rank runs its calls in the order the driver queued them, so the next iteration's
generation (rank 0's) and old-logprob pass (collective under FSDP and EP: rank 1 waits in it while rank 0
generates) run before this iteration's update on every rank alike, and the last iteration's update brings
back the state the previous update's export swapped out (no pass of its own runs between them). The DP 1
jobs here and in test_harness_job.py and test_agent_partial_job.py run ahead at generation TP 1.

What proves it right: iterations 1 and 2 both sample from the initial weights (the second's generation
and old-logprob pass run ahead of the first update), so the FSDP x EP job's engine must sample the DDP
job's responses (rewards and lengths exactly: two TP-2 engines loaded from the same files) and train on
them as it does, up to float32 reassociation (FSDP's gathers and reduce-scatters, EP's all-to-all sum in
another order; tolerance below). From iteration 3 the
engines sample from weights that differ by that rounding, which may flip a sampled token, so there every
job is held to the float32 gap between its engine and its old-logprob pass (jobs.check_float32_gap: the
engine holds exactly the weights that pass ran on; one that missed an update's push is off by 1e-3 and
more).
"""

from __future__ import annotations

from typing import Any

import jobs  # tests/jobs.py
import pytest
from numerics import EPS32  # tests/numerics.py

pytestmark = pytest.mark.integration

G, N, ITERATIONS = 4, 4, 3
SAME_ROLLOUT = ("reward_mean", "reward_std", "response_length_mean", "prompt_length_mean")
TRAINING = ("loss", "policy_loss", "kl", "entropy", "grad_norm", "clip_fraction")
# The longest chain of float32 sums behind a training metric (tests/numerics.py): in each of the tiny MoE's
# 2 layers the attention's projections over the hidden size and its heads (128 + 128), an expert's MLP out
# and back (256 + 128) and the 2 experts' mix; then the vocabulary's softmax (16) and the mean over an
# iteration's G x N x 6 response tokens. Scaled by the metric or by 1 (the per-token terms: advantages of
# unit spread, log-ratios and KL terms below 1), whichever is larger, it holds on any CPU and thread count;
# measured: 5e-7 at most (the gradient norm, 2.3: 2 ulp), against a bound of 1.7e-4 x 2.3.
NUM_TERMS = 2 * (128 + 128 + 256 + 128 + 2) + 16 + G * N * 6
MOE = {"builder": "tiny-qwen3-moe"}
FSDP_X_EP = {"strategy": "fsdp", "expert_parallel_size": 2, "resharding": "allgather_swap"}
GENERATION_TP2 = {"cpu_kv_cache_gib": 0.25, "tensor_parallel_size": 2}  # one engine for the two ranks
# The jobs' changes to the base config below, by section.
JOBS: dict[str, dict[str, dict[str, Any]]] = {
    "on_policy": {"dock": {"max_staleness": 0}},
    "ddp": {"model": MOE, "training": {"data_parallel_size": 2}, "rollout": GENERATION_TP2},
    "fsdp_x_ep": {"model": MOE, "training": {"data_parallel_size": 2, **FSDP_X_EP}, "rollout": GENERATION_TP2},
}


def async_config(root, changes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    builder = changes.get("model", {}).get("builder", "tiny-qwen2")
    config: dict[str, Any] = {
        "name": "it-async",
        "seed": 1,
        "iterations": ITERATIONS,
        "model": {"path": str(root / builder), "builder": builder},  # each model built once, by its first job
        "algorithm": {
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": 8,
            "max_response_length": 6,
            "learning_rate": 1e-4,
        },
        "training": {"mode": "async", "data_parallel_size": 1, "micro_batch_size": 8},
        "dock": {"timeout_s": 120, "max_staleness": 1},
        "checkpoint": {"interval": 1, "keep_last": 1},  # a checkpoint while the next iteration runs ahead
        "monitoring": {"mismatch": {"max_kl": 10, "action": "warn"}},  # the engines' gap, measured only
        "rollout": {"cpu_kv_cache_gib": 0.25},
    }
    for section, fields in changes.items():
        config[section] = {**config[section], **fields}
    return config


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("async-job")
    return {
        name: jobs.run(async_config(root, changes), root / name, max_restarts=None).records
        for name, changes in JOBS.items()
    }


@pytest.mark.parametrize(
    ("job", "expected"), [("on_policy", [0.0, 0.0, 0.0]), ("ddp", [0.0, 1.0, 1.0]), ("fsdp_x_ep", [0.0, 1.0, 1.0])]
)
def test_async_samples_are_as_stale_as_the_bound_allows(runs, job, expected):
    records = runs[job]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    # Iteration 1 is generated by the initial policy, which is also the one its update starts from.
    assert [r["staleness_mean"] for r in records] == expected
    assert [r["staleness_max"] for r in records] == expected
    for record in records:
        update = record["dock"]["controllers"]["update"]
        assert update["samples_handed_out"] == G * N and update["stale_dropped"] == 0, record["iteration"]
        assert record["timing"]["update"] > 0 and 0 <= record["reward_mean"] <= 1
        assert record["rollout/num_engines"] == 1  # DP 1, or DP 2 at generation TP 2


def test_fsdp_x_ep_ranks_run_ahead_as_ddp_ranks_do(runs):
    ddp, sharded = runs["ddp"], runs["fsdp_x_ep"]
    for a, b in zip(ddp[:2], sharded[:2], strict=True):  # both sampled by the initial weights (module docstring)
        assert {key: b[key] for key in SAME_ROLLOUT} == {key: a[key] for key in SAME_ROLLOUT}, a["iteration"]
        for key in TRAINING:
            tolerance = NUM_TERMS * EPS32 * max(1.0, abs(a[key]))
            assert abs(b[key] - a[key]) <= tolerance, (a["iteration"], key, a[key], b[key])
    assert ddp[1]["kl"] > 0  # iteration 2 trains a policy that moved: its update is not the first one's again
    for record in sharded:
        assert record["grad_norm"] > 0 and "moe/aux_loss" in record  # the experts trained
        for rank in (0, 1):  # allgather_swap: no training state on the device while generating
            ledger = record["ledger"]
            assert sum(ledger[f"memory/rank{rank}/generation/{c}"] for c in ("train_params", "grads")) == 0
            assert ledger[f"memory/rank{rank}/generation/host_swap"] > 0


@pytest.mark.parametrize("job", list(JOBS))
def test_every_engine_samples_with_the_weights_its_old_logprob_pass_runs(runs, job):
    """The weight push after each update (under FSDP x EP gathered from the shards and the EP group's
    experts) reaches the engines before the generation queued behind it."""
    for record in runs[job]:
        jobs.check_float32_gap(record)
