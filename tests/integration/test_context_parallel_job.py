"""`training.context_parallel_size` 2 in real `rldock train` jobs, alone and with TP 2: PPO (the policy, a
reference for the KL term and the critic, each trained or passed under CP) on a tiny Qwen2 of 4 heads and
4 KV heads (so a TP rank's 2 and 2 split again by CP 2; the demo model's 2 KV heads allow CP 2 only), at
DP 1 x CP 2 and DP 1 x CP 2 x TP 2 under FSDP, against the same job at CP 1, on local Ray.

The actor ranks each hold a vLLM engine (2 or 4 generation replicas against 1), but the rollout samples
each prompt group with its own seed (its key, not the rank), so the jobs train on the same
responses; the CP group reads each share once and computes one loss over it, its gradient the sum
of the ranks' shares. The reference ranks (DP x CP of them) run their pass under CP too: each
CP group's first rank reads the samples and every rank of the group passes all of them, a slice of
each sequence apiece, so the KL term compares against the same reference logprobs at any CP. PPO's
critic ranks are DP x CP as well: the value model's passes run over the critic's CP group, which
reads each share once (every CP rank takes the whole iteration, as one data-parallel rank). So
every iteration's rollout must be the same (rewards and lengths exactly) and its loss, KL, entropy,
gradient norms, values and value loss equal to the CP 1 job's up to float32 reassociation (the
ranks' gradient shares summed, FSDP's reduce-scatter): measured at most 4e-7 relative on this
machine (the KL at CP 4); the tolerance, 1e-4 relative and 1e-6 absolute (the policy loss is tiny
at ratio 1), holds on any CPU and thread count, while a CP group that trained its ranks as two
data-parallel ranks, reduced by the wrong factor or sharded a sequence wrong is off by 1e-2 and up.
The CP 2 job stops after iteration 2 and resumes from its checkpoint (the gathered weights and
optimizer state, the same files at any CP size) for the 3rd, which must match the CP 1 job's 3rd;
the CP 2 x TP 2 job runs the same 3 iterations (the 3rd's KL the first against a policy that moved)
with ring attention (`training.context_parallel_mode: ring`), the other CP mode, over each TP rank's
heads: the same sums cut into key blocks rather than heads and TP's partial sums added, so the same
tolerance holds; its reference and critic run CP 2 on 2 ranks (TP splits the actor only). CP 4 in
both modes, Ulysses x TP 2 and ring on a head count no CP size divides run as ranks
(test_context_parallel_ranks.py, test_context_tensor_parallel_ranks.py).

Four jobs in all (one GRPO and one PPO job per CP size ran before; PPO's flow holds GRPO's passes
and the critic's).
"""

from __future__ import annotations

from pathlib import Path

import jobs  # tests/jobs.py
import pytest

from rldock.runtime.models.tiny import build_tiny_model

pytestmark = pytest.mark.integration

ITERATIONS, CHECKPOINT_AT = 3, 2
SAMPLES = 16  # algorithm.num_prompts_per_iteration x num_responses_per_prompt below
SAME_ROLLOUT = ("reward_mean", "reward_std", "response_length_mean", "prompt_length_mean")
TRAINING = ("loss", "policy_loss", "kl", "entropy", "grad_norm", "clip_fraction")
CRITIC = ("value_loss", "value_mean", "value_grad_norm")
# Under TP only the first iteration is compared number for number (check_as_cp1). Its rewards are all 0, so the policy's
# gradient is the KL term's alone, which is 0 at CP 1 (the reference's logprobs are the policy's, bit for bit)
# but under TP the reference (no TP) and the policy (TP's partial sums) differ by float32 rounding: a gradient
# norm of 3e-8 (measured), which AdamW's normalised step turns into a step of up to the learning rate per
# weight. From iteration 2 on the job trains from other weights (measured: KL 2.9e-5 against 0, the gradient
# norm 7e-4 off in iteration 2, 1% in iteration 3), so a sampled token may flip. The ranks test
# (test_context_tensor_parallel_ranks.py) compares CP x TP's every gradient with one process's at 1e-9.


def run_job(
    root: Path, cp: int, *, iterations: int, resume: bool = False, mode: str = "ulysses", tp: int = 1
) -> list[dict]:
    """ppo-tiny.yaml at context parallel size `cp` under `mode` (TP `tp`), in root/ppo-tiny-cp<cp>-<mode>[-tp<tp>]:
    its records."""
    overrides = jobs.small_layout(
        root,
        iterations,
        {
            "training.data_parallel_size": 1,
            "training.context_parallel_size": cp,
            "training.context_parallel_mode": mode,
            "training.tensor_parallel_size": tp,
            "training.strategy": "fsdp",
            "training.micro_batch_size": 16,  # one packed pass per update step, the same rows at any CP
            "dock.timeout_s": 120,
            "checkpoint.interval": CHECKPOINT_AT,
            "evaluation.interval": 0,
        },
    )
    name = f"ppo-tiny-cp{cp}-{mode}" + (f"-tp{tp}" if tp > 1 else "")
    return jobs.run("ppo-tiny.yaml", root / name, overrides, resume=resume).records


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("context-parallel-job")
    # 4 KV heads (head size 32, as vLLM's CPU attention needs): CP 4 divides them.
    build_tiny_model(root / "model", texts=["0123456789+="], seed=0, num_heads=4, num_kv_heads=4)
    one = run_job(root, 1, iterations=ITERATIONS)
    stopped = run_job(root, 2, iterations=CHECKPOINT_AT)
    return {
        "cp1": one,
        "cp2_stopped": stopped,
        "cp2": run_job(root, 2, iterations=ITERATIONS, resume=True),
        "cp2_tp2_ring": run_job(root, 2, iterations=ITERATIONS, mode="ring", tp=2),
    }


def check_as_cp1(one: list[dict], other: list[dict], *, cp: int, tp: int = 1) -> None:
    """`other`, a DP 1 x CP `cp` (x TP `tp`) job's records, against the CP 1 job's `one` (module docstring):
    every iteration's numbers, or under TP the first's (the comment above), and every iteration's layout."""
    for a, b in zip(one, other, strict=True):
        assert (a["rollout/num_engines"], b["rollout/num_engines"]) == (1, cp * tp)  # cp x tp actor ranks ran
        if tp == 1 or a["iteration"] == 1:
            assert {key: b[key] for key in SAME_ROLLOUT} == {key: a[key] for key in SAME_ROLLOUT}, a["iteration"]
            for key in (*TRAINING, *CRITIC):
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["iteration"], key)
        # Both CP ranks of the critic take the whole iteration, as its one data-parallel rank.
        samples = a["critic_ranks"]["rank0"]["update_samples"]
        assert {rank: b["critic_ranks"][f"rank{rank}"]["update_samples"] for rank in range(cp)} == dict.fromkeys(
            range(cp), samples
        )
        # Every reference rank of the CP group passed all the group's samples (a slice of each).
        assert a["reference_ranks"] == {"rank0": {"samples": SAMPLES}}
        assert b["reference_ranks"] == {f"rank{r}": {"samples": SAMPLES} for r in range(cp)}
        # FSDP shards over the DP x CP ranks: each CP rank holds 1/cp of what the lone CP 1 rank holds; TP
        # splits the decoder layers' linears again (the embeddings and the head stay whole over TP).
        whole = a["ledger"]["memory/rank0/after_update/train_params"]
        shards = [b["ledger"][f"memory/rank{r}/after_update/train_params"] for r in range(cp * tp)]
        if tp == 1:
            assert sum(shards) == pytest.approx(whole, rel=0.01)
        else:
            assert whole / cp > max(shards) > whole / (cp * tp)
        assert max(shards) == pytest.approx(min(shards), rel=0.05 * cp / 2)
        # Each CP rank counts its slice of every pass: together the CP 1 rank's work, plus the
        # padding of each pass's sequence to a multiple of cp.
        for stage in ("update", "reference"):
            assert b[f"flops/{stage}"] == pytest.approx(a[f"flops/{stage}"], rel=0.05 * cp / 2), stage


def test_a_cp2_job_trains_as_the_cp1_job_and_resumes(runs):
    one, two = runs["cp1"], runs["cp2"]
    assert [r["iteration"] for r in one] == [r["iteration"] for r in two] == [1, 2, 3]
    assert two[:CHECKPOINT_AT] == runs["cp2_stopped"]  # the resumed job kept the records it had
    check_as_cp1(one, two, cp=2)
    assert one[2]["kl"] > 0  # the policy moved in iteration 2 (in iteration 1 no reward was above 0)
    assert one[1]["value_grad_norm"] > 0 and one[2]["value_mean"] != 0.0  # the critic trained in iteration 2


def test_a_cp2_by_tp2_ring_attention_job_trains_as_the_cp1_job(runs):
    assert [r["iteration"] for r in runs["cp2_tp2_ring"]] == [1, 2, 3]
    check_as_cp1(runs["cp1"], runs["cp2_tp2_ring"], cp=2, tp=2)
    third = runs["cp2_tp2_ring"][2]
    assert third["kl"] > 0 and third["value_grad_norm"] > 0  # the policy moved and the critic trained
