"""The critic's metrics over its data-parallel ranks: training metrics averaged (as the actor's),
each rank's samples per stage and its weights' sum kept apart; the reference ranks' samples per rank."""

from __future__ import annotations

from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.records import critic_metrics, reference_metrics


def _update(rank: int, value_loss: float, weights_sum: float) -> StageResult:
    metrics = {"value_loss": value_loss, "value_clip_fraction": 0.0, "value_mean": 0.5, "value_grad_norm": 1.0}
    return StageResult(dispatch_s=0.1, compute_s=1.0, num_samples=8).with_metrics(
        rank=rank, weights_sum=weights_sum, **metrics
    )


def test_training_metrics_are_averaged_and_samples_kept_per_rank():
    # Rank 1 returned first: results come back in completion order, ranks are named by the worker.
    inferences = [StageResult(num_samples=12, metrics={"rank": 1}), StageResult(num_samples=4, metrics={"rank": 0})]
    metrics = critic_metrics(inferences, [_update(1, 0.3, 2.5), _update(0, 0.1, 2.5)])
    assert abs(metrics["value_loss"] - 0.2) < 1e-12 and metrics["value_mean"] == 0.5
    assert metrics["critic_ranks"] == {
        "rank0": {"inference_samples": 4, "update_samples": 8, "weights_sum": 2.5},
        "rank1": {"inference_samples": 12, "update_samples": 8, "weights_sum": 2.5},
    }
    assert "num_samples" not in metrics and "weights_sum" not in metrics


def test_a_job_without_a_critic_has_nocritic_metrics():
    assert critic_metrics([], []) == {}


def test_the_reference_ranks_samples_are_kept_per_rank():
    # Under CP 2 both ranks of the CP group pass the group's 16 samples; a second call adds up.
    results = [StageResult(num_samples=n, metrics={"rank": r}) for r, n in ((1, 16), (0, 16), (0, 4))]
    assert reference_metrics(results) == {"reference_ranks": {"rank0": {"samples": 20}, "rank1": {"samples": 16}}}
    assert reference_metrics([]) == {}
