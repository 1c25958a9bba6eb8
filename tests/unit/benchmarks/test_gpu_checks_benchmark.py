"""The GPU checks' code, run on the CPU with a one-layer model (the checks themselves ran on an H100:
docs/accelerators.md), so what a GPU machine runs keeps working between the sessions that have one."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from rldock_benchmarks import gpu_checks, gpu_processes

# SmolLM2's vocabulary (49152) makes the LM head about 7 of every 8 multiply-adds of a one-layer model; the
# checks compare passes, wrappers and layouts, which a small head runs through the same code (the head's
# chunking over positions is head_logprobs' own test: tests/unit/runtime/engines/test_head_logprobs.py).
VOCAB = 2048
ARGS = argparse.Namespace(device="cpu", layers=1, vocab=VOCAB, repeats=1, rounds=1)


def test_seam_steps_the_plain_ddp_and_fsdp_models_to_the_same_weights():
    result = gpu_checks.check_seam(ARGS)
    assert result["backend"] == "gloo" and result["device"] == "cpu"
    assert len(set(result["losses"].values())) == 1
    assert all(diff <= gpu_checks.WEIGHT_ATOL for diff in result["max_weight_difference_after_one_step"].values())
    assert result["ok"]


def test_packed_and_row_passes_agree_and_the_planner_is_read_for_the_example():
    result = gpu_checks.check_passes(ARGS)
    assert result["max_logprob_difference_packed_vs_rows"] <= gpu_checks.LOGPROB_ATOL
    assert result["micro_batch_size"] == 8  # examples/grpo-smollm2-math.yaml
    planner = result["planner"]
    assert planner["update_bytes"] == planner["training_state_bytes"] + planner["activation_bytes"] > 0
    assert planner["measured_peak_rows_over_planned"] is None  # no allocator to measure on the CPU
    assert result["ok"]
    from rldock.runtime.engines import packing, policy

    assert policy.packs_sequences is packing.packs_sequences  # the product's choice back for later tests


def test_compiled_passes_score_as_the_model_does():
    # through the command, so the compile stays in a process of its own (about a minute on the CPU)
    run = subprocess.run(
        [sys.executable, "-m", "rldock_benchmarks.gpu_checks", "--device", "cpu", "--layers", "1"]
        + ["--vocab", str(VOCAB), "--repeats", "1", "--checks", "compiled"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout)["results"]["compiled"]
    assert result["max_logprob_difference_compiled_vs_eager"] <= gpu_checks.LOGPROB_ATOL
    assert result["compiled"]["first_update_s"] > result["compiled"]["seconds_per_update"]  # the compile
    assert set(result) >= {"compile_s", "compiled_over_eager_seconds", "updates_to_pay_back"}


def test_swap_restores_the_same_tensors_and_values():
    result = gpu_checks.check_swap(ARGS)
    assert result["training_state_bytes"] > 0 and result["restored_same_tensors_and_values"]
    assert result["ok"]


def test_swap_check_fails_a_swap_in_that_restores_other_bytes(monkeypatch):
    from rldock.runtime.resharding.swap import TensorSwapper

    swap_in = TensorSwapper.swap_in

    def changing(self, categories=None):
        self.host[0] += 1  # the first swapped tensor's first byte comes back changed
        return swap_in(self, categories)

    monkeypatch.setattr(TensorSwapper, "swap_in", changing)
    result = gpu_checks.check_swap(ARGS)
    assert not result["restored_same_tensors_and_values"] and not result["ok"]


def test_row_passes_turn_packing_off_and_back_on():
    from rldock.runtime.engines import policy

    update = gpu_checks.PolicyUpdate("cpu", 1, micro_batch_size=8, vocab=VOCAB)
    batch = update.batch

    def packing():
        return policy.packing_prompts(
            update.model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_attention_mask"],
            trim=True,
            micro_batch_size=8,
        )

    assert packing() is not None  # the product packs this batch
    with gpu_checks.row_passes(True):
        assert packing() is None
    assert packing() is not None


def test_processes_runs_both_layouts_and_reports_each():
    result = gpu_processes.compare(ARGS)
    assert set(result["layouts"]) == {"one_process", "two_processes"}
    assert len(result["layouts"]["two_processes"]["allocator_reserved_mib"]) == 2
    assert result["exit_codes"] == [0, 0, 0] and result["ok"]


def test_the_gpu_run_refuses_a_machine_without_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_checks.main(["--checks", "seam"])


def test_processes_fails_rather_than_waits_when_a_layouts_process_dies():
    # no timed iteration: the child's median raises after its warm-up, and it exits with 1
    broken = argparse.Namespace(**{**vars(ARGS), "repeats": 0})
    with pytest.raises(RuntimeError, match="one_process exited with 1"):
        gpu_processes.compare(broken)


def test_moe_kernels_and_the_expert_parallel_dispatch_score_alike():
    result = gpu_checks.check_moe(ARGS)
    assert result["backend"] == "gloo" and result["ok"], result
