"""A PPO job end to end, kept short (2 iterations): the critic worker's states run through the
transfer dock like every other state, and its metrics and checkpoint come out (on the FSDP critic
ranks' run, which the test of those ranks shares); a PPO run resumed
after iteration 1 trains bit for bit like an uninterrupted one; and with data_parallel_size 2 both
critic ranks share the samples and keep equal weights (DDP) or one sharded model (FSDP), across a
resume too."""

from __future__ import annotations

import jobs  # tests/jobs.py
import pytest

pytestmark = pytest.mark.integration

G, N = jobs.PPO_G, jobs.PPO_N


# pf_ppo and the ddp critic ranks are opt-in (`make test-slow`, .ci/run's budget; README, "slow"):
# ppo runs the same dataflow, and the fsdp critic ranks the same two-rank share and resume. The ppo
# case reads the fsdp critic ranks' run (DP 2, resumed after iteration 1): the dataflow asserted here is
# the same at any layout, and PPO's critic at DP 1 under DDP runs in test_phase_schedule_job's and
# test_environment_job's turn-credit jobs. The fsdp critic ranks' run is the session's
# (conftest.py's ppo_fsdp_critic_ranks), which test_generation_tp_job also reads.
@pytest.mark.parametrize("algorithm", ["ppo", pytest.param("pf_ppo", marks=pytest.mark.slow)])
def test_ppo_job_runs_every_state_through_the_dock(tmp_path, algorithm, request):
    if algorithm == "ppo":
        output, records = request.getfixturevalue("ppo_fsdp_critic_ranks")
    else:
        output, records = tmp_path / "run", jobs.ppo_job(tmp_path, algorithm)
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        assert record["value_loss"] >= 0 and 0 <= record["value_clip_fraction"] <= 1
        for stage in ("critic_inference", "critic_update", "advantage", "update"):
            assert record["timing"][stage] >= 0, stage
        controllers = record["dock"]["controllers"]
        assert set(controllers) >= {"critic_inference", "critic_update"}
        for state, counters in controllers.items():
            assert counters["samples_handed_out"] == G * N, state
    # The zero-initialised value head predicts 0 until the critic's first update.
    assert records[0]["value_mean"] == 0.0 and records[1]["value_mean"] != 0.0
    assert (output / "checkpoints" / "iter-000002" / "critic.pt").is_file()


TRAINING_METRICS = (
    "reward_mean",
    "response_length_mean",
    "loss",
    "policy_loss",
    "kl",
    "entropy",
    "clip_fraction",
    "grad_norm",
    "value_loss",
    "value_mean",
    "value_grad_norm",
)


@pytest.mark.slow  # opt-in (`make test-slow`): .ci/run's budget; README, "slow"
def test_a_resumed_ppo_run_trains_bit_for_bit_like_an_uninterrupted_one(tmp_path):
    # One micro-batch holds the iteration's G*N samples, so every stage computes on the same batch
    # shapes whatever order the dock hands samples out in (CPU kernels round differently per shape).
    whole = jobs.ppo_job(tmp_path, "ppo", micro_batch_size=G * N, output="whole")
    jobs.ppo_job(tmp_path, "ppo", micro_batch_size=G * N, output="resumed", iterations=1)
    resumed = jobs.ppo_job(tmp_path, "ppo", micro_batch_size=G * N, output="resumed", resume=True)
    assert [r["iteration"] for r in resumed] == [1, 2]
    for key in TRAINING_METRICS:
        assert [r[key] for r in resumed] == [r[key] for r in whole], key


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_two_critic_ranks_share_the_samples_and_stay_equal_across_a_resume(tmp_path, strategy, request):
    # Iteration 1, a checkpoint, then iteration 2 resumed from it: rank 1 must load the checkpoint
    # rank 0 wrote (or its weights and optimizer state would differ from rank 0's after the update);
    # under FSDP each rank keeps its shards of the whole file rank 0 gathered. Two micro-batches per
    # rank: the first backward's gradients accumulate unsynchronised.
    if strategy == "fsdp":
        _, records = request.getfixturevalue("ppo_fsdp_critic_ranks")
    else:
        _, records = jobs.two_critic_ranks(tmp_path, strategy)
    assert [r["iteration"] for r in records] == [1, 2]
    for record in records:
        ranks = record["critic_ranks"]
        assert sorted(ranks) == ["rank0", "rank1"]
        # The update deals each rank exactly half; DDP inference ranks take micro-batches as they
        # come, FSDP's (a collective forward) exactly half too.
        assert [ranks[r]["update_samples"] for r in ("rank0", "rank1")] == [G * N // 2] * 2
        assert ranks["rank0"]["inference_samples"] + ranks["rank1"]["inference_samples"] == G * N
        if strategy == "fsdp":
            assert ranks["rank0"]["inference_samples"] == G * N // 2
        assert ranks["rank0"]["weights_sum"] == ranks["rank1"]["weights_sum"]
    assert records[0]["critic_ranks"]["rank0"]["weights_sum"] != records[1]["critic_ranks"]["rank0"]["weights_sum"]
    assert records[0]["value_mean"] == 0.0 and records[1]["value_mean"] != 0.0
