"""Per-iteration metrics: the record built from an iteration's stage results, the metrics.jsonl log
(resume-safe), the throughput formula and the plot."""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rldock.contract.progress import (
    CHECKPOINT_ESTIMATE_S,
    CHECKPOINT_S,
    ITERATION_S,
    MISMATCH_KL,
    evaluation_headline,
    format_progress,
    headline_key,  # noqa: F401  (re-exported: callers read it with the metrics)
)
from rldock.runtime.agent.episode_metrics import agent_metrics
from rldock.runtime.algorithms.rollout_correction import MISMATCH_KEY, merge_mismatch
from rldock.runtime.checkpoint import Checkpoint
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.evaluation import val_metrics
from rldock.runtime.driver.utilisation import UtilisationInputs, stage_utilisation
from rldock.runtime.flow.states import (
    ACTOR_INFERENCE,
    CRITIC_INFERENCE,
    CRITIC_UPDATE,
    REFERENCE_INFERENCE,
    REWARD_STATE,
    ROLLOUT,
    ROLLOUT_RESUME,
)
from rldock.runtime.rewards import merge_reward_metrics

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "progress.png"


def tokens_per_s_per_device(
    *,
    num_prompts: int,
    num_responses: int,
    prompt_length: float,
    response_length: float,
    num_devices: int,
    seconds: float,
) -> float:
    """The MindSpeed RL paper's throughput T = G*N*(PL+SL)/ND/ETE, in tokens/s per device.

    PL and SL are the iteration's mean prompt and response lengths (tokens actually processed, not
    the configured maxima) and ETE the end-to-end seconds of the iteration.
    """
    if seconds <= 0 or num_devices <= 0:
        raise ValueError("seconds and num_devices must be positive")
    return num_prompts * num_responses * (prompt_length + response_length) / num_devices / seconds


def iteration_record(
    results: dict[str, list[StageResult]],
    *,
    iteration: int,
    update_state: str,
    prompt_lengths: Sequence[int],
    rewards: Sequence[float],
    response_lengths: Sequence[int],
    put_seconds: float,
    seconds: float,
    cycle: float | None,
    num_prompts: int,
    num_responses: int,
    num_devices: int,
    rollout_counters: Sequence[str],
    round_metrics: dict,
    data_metrics: dict,
    utilisation: UtilisationInputs | None = None,
) -> dict[str, Any]:
    """An iteration's metrics record from what its stages returned (`results`: state -> one result
    per rank call) and a few driver figures; the trainer adds the dock traffic and phase timeline.

    `rewards` (each sample's reward before shaping; none without a reward state) and
    `response_lengths` are the samples' facts the driver read from the dock (schedule.Stages.facts:
    with DAPO's sampling rounds every round's samples, the dropped groups' too, as
    reward_mean/reward_std and response_length_mean have always averaged them);
    `put_seconds` is the driver's time putting samples, `seconds` the iteration's and `cycle` the
    time since the previous iteration ended (None for the loop's first). With `utilisation`, each
    stage's `flops/`, `mfu/` and the rollout's `mbu/` (utilisation.stage_utilisation).
    """
    rollouts = results.get(ROLLOUT.name, []) + results.get(ROLLOUT_RESUME.name, [])  # partial rollout's two rounds
    updates = results[update_state]
    prompt_length = statistics.fmean(prompt_lengths)
    response_length = statistics.fmean(response_lengths)
    reward_stats = (
        {"reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards)} if rewards else {}
    )
    return {
        "iteration": iteration,
        **reward_stats,
        **merge_reward_metrics([r.metrics["reward_metrics"] for r in results.get(REWARD_STATE.name, [])]),
        "response_length_mean": response_length,
        "prompt_length_mean": prompt_length,
        **update_metrics(updates),
        "tokens_per_s_per_device": tokens_per_s_per_device(
            num_prompts=num_prompts,
            num_responses=num_responses,
            prompt_length=prompt_length,
            response_length=response_length,
            num_devices=num_devices,
            seconds=seconds,
        ),
        **critic_metrics(results.get(CRITIC_INFERENCE.name, []), results.get(CRITIC_UPDATE.name, [])),
        **mismatch_metrics(results.get(ACTOR_INFERENCE.name, [])),
        **reference_metrics(results.get(REFERENCE_INFERENCE.name, [])),
        # one rollout result per engine (DAPO's rounds are merged per worker)
        **({"rollout/num_engines": len(results[ROLLOUT.name])} if results.get(ROLLOUT.name) else {}),
        **pool_metrics(results.get(ROLLOUT.name, [])),
        **per_rank_metrics(updates),
        **round_metrics,
        **{f"rollout/{key}": sum(int(r.metrics.get(key, 0)) for r in rollouts) for key in rollout_counters},
        **agent_metrics([r.metrics["agent"] for r in rollouts if "agent" in r.metrics]),
        **data_metrics,
        **(
            stage_utilisation(results, utilisation, prompt_lengths=prompt_lengths, response_lengths=response_lengths)
            if utilisation is not None
            else {}
        ),
        "timing": stage_timing(results, put_seconds=put_seconds, seconds=seconds, cycle=cycle),
    }


def mismatch_metrics(inference: Sequence[StageResult]) -> dict[str, float]:
    """The `mismatch/` metrics (algorithm.rollout_correction, monitoring.mismatch) over every batch of every
    rank of the old-logprob pass (each batch's part merged, as if one batch: algorithms/rollout_correction.py);
    none in a job that does not measure the gap."""
    parts = [part for result in inference for part in result.metrics.get(MISMATCH_KEY, [])]
    return merge_mismatch(parts) if parts else {}


def stage_timing(
    results: dict[str, list[StageResult]], *, put_seconds: float, seconds: float, cycle: float | None
) -> dict[str, float]:
    """Seconds per stage (`timing/<state>`), per stage's own work (`compute/`), its wait for upstream
    samples (`idle/`), the dock traffic's (`dispatch`), the iteration's and the cycle's."""
    # A stage's time is its slowest rank's busy time (moving data + computing); waiting for
    # upstream stages is excluded, since all stages run at once and overlap.
    timing = {stage: max(r.dispatch_s + r.compute_s for r in rs) for stage, rs in results.items()}
    # compute: of that, the slowest rank's own work (model passes, scoring), without the dock.
    timing.update({f"compute/{stage}": max(r.compute_s for r in rs) for stage, rs in results.items() if rs})
    # dispatch: all time spent moving samples through the dock, summed over every worker.
    timing["dispatch"] = put_seconds + sum(r.dispatch_s for rs in results.values() for r in rs)
    timing["iteration"] = seconds
    if cycle is not None:  # the loop's first iteration has no previous end
        timing["cycle"] = cycle
    # idle: how long each state's ranks (mean over them) waited on the dock for upstream samples.
    timing.update({f"idle/{stage}": statistics.fmean(r.wait_s for r in rs) for stage, rs in results.items() if rs})
    return timing


# Update results whose values are dicts named per rank (the resharding memory ledger and times):
# merged over ranks, not averaged.
PER_RANK_KEYS = ("ledger", "resharding")
# What a stage's passes computed (engines/policy.PassTally): summed into `flops/<stage>`, not averaged.
COMPUTED_KEY = "computed"


def pool_metrics(rollouts: Sequence[StageResult]) -> dict:
    """The rollout pool's part of the iteration (rollout.pool; none without one): `rollout/pool_samples` per
    engine that generated (`engine{i}`, by the pool's numbering, a replacement's after the others') and in all,
    and the weight load's seconds (`rollout/pool_weights_load_s`, the slowest engine's; the host copy actor rank 0
    made of the version, `rollout/pool_publish_copy_s`) in an iteration whose engines loaded one."""
    pooled = [r for r in rollouts if "pool_samples" in r.metrics]
    if not pooled:
        return {}
    per_engine: dict[str, int] = {}
    for result in pooled:
        for key, samples in result.metrics["pool_samples"].items():
            per_engine[key] = per_engine.get(key, 0) + samples
    loads = [r.metrics for r in pooled if "pool_weights_load_s" in r.metrics]
    return {
        "rollout/pool_samples": sum(per_engine.values()),
        "rollout/pool_engine_samples": per_engine,
        **(
            {
                "rollout/pool_weights_load_s": max(m["pool_weights_load_s"] for m in loads),
                "rollout/pool_publish_copy_s": loads[0]["pool_publish_copy_s"],
            }
            if loads
            else {}
        ),
    }


def update_metrics(updates: Sequence[StageResult]) -> dict:
    """Mean over ranks of every training metric the update stage returned (its metrics, not its timing)."""
    skip = {COMPUTED_KEY, *PER_RANK_KEYS}
    return {key: statistics.fmean(u.metrics[key] for u in updates) for key in updates[0].metrics if key not in skip}


def per_rank_metrics(updates: Sequence[StageResult]) -> dict:
    """{"ledger": {"memory/rank{r}/...": ...}, ...} merged over the ranks that returned them."""
    merged = {
        key: {name: value for u in updates for name, value in u.metrics.get(key, {}).items()} for key in PER_RANK_KEYS
    }
    return {key: values for key, values in merged.items() if values}


def critic_metrics(inferences: Sequence[StageResult], updates: Sequence[StageResult]) -> dict:
    """The critic's training metrics, mean over its ranks (as the actor's), and per rank
    (`critic_ranks/rank{r}/...`) the samples it took in each stage and its weights' sum after the
    update (equal on every rank while DDP keeps them in step)."""
    if not updates:
        return {}
    keys = ("value_loss", "value_clip_fraction", "value_mean", "value_grad_norm")
    ranks: dict[str, dict[str, float]] = {}
    for stage, results in (("inference_samples", inferences), ("update_samples", updates)):
        for result in results:
            rank = ranks.setdefault(f"rank{result.metrics['rank']}", {"inference_samples": 0, "update_samples": 0})
            rank[stage] += result.num_samples
            if "weights_sum" in result.metrics:
                rank["weights_sum"] = result.metrics["weights_sum"]
    return {**{key: statistics.fmean(u.metrics[key] for u in updates) for key in keys}, "critic_ranks": ranks}


def reference_metrics(inferences: Sequence[StageResult]) -> dict:
    """Per reference rank (`reference_ranks/rank{r}/samples`) the samples its passes took: under CP
    every rank of a CP group passes the group's samples, each computing 1/cp of every sequence."""
    ranks: dict[str, dict[str, int]] = {}
    for result in inferences:
        rank = ranks.setdefault(f"rank{result.metrics['rank']}", {"samples": 0})
        rank["samples"] += result.num_samples
    return {"reference_ranks": ranks} if ranks else {}


class MetricsLog:
    """metrics.jsonl with one JSON object per finished iteration, never holding an iteration twice, and its
    drawing, progress.png (`draw`)."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / METRICS_FILE
        self.plot_path = Path(output_dir) / PLOT_FILE
        self._drawn: int | None = None  # how many records progress.png shows

    def draw(self) -> list[dict[str, Any]]:
        """progress.png of the records (returned), unless no record came since the last drawing (the end of a
        run just after its last checkpoint). The trainer draws at each checkpoint in its bookkeeping thread, off
        the loop (a drawing takes about 0.16 s of CPU, the first 0.5 s with matplotlib's import, where the demo's
        iteration takes 0.1 s), and at the end of the run. A drawing that fails is logged, not raised: the
        picture is the records' view, and a checkpoint's must not fail the iterations after it."""
        records = self.read()
        if len(records) != self._drawn:
            try:
                plot_progress(records, self.plot_path)
            except Exception:
                logger.exception("%s not drawn from %d records", self.plot_path, len(records))
                return records
            self._drawn = len(records)
        return records

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    # A run killed mid-write leaves a torn last line; that iteration was not
                    # checkpointed either, so it is redone and logged again.
                    break
        return records

    def truncate_after(self, iteration: int) -> list[dict[str, Any]]:
        """Drop records past `iteration` (done after the last checkpoint, so they will be redone)."""
        kept = [r for r in self.read() if r["iteration"] <= iteration]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
        return kept

    def append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def progress_line(
    record: dict[str, Any],
    iterations: int,
    checkpoint: Checkpoint | None,
    last_evaluation: dict[str, Any] | None,
    checkpoint_estimate_s: float | None = None,
) -> str:
    """The iteration's machine-readable progress line (rldock.contract.progress): its figures rounded
    (DPO records have no sampled reward; its preference accuracy stands in: headline_key), the train-inference
    mismatch where the job measures it, the newest `checkpoint`'s iteration and the seconds its save took (before
    one was measured, `checkpoint_estimate_s`), the iteration's (its cycle where longer: what a stop may wait
    for) and the last evaluation."""
    keys = (headline_key(record), "kl", "loss", "response_length_mean", "tokens_per_s_per_device")
    gap = {MISMATCH_KL: float(f"{record['mismatch/kl']:.4g}")} if "mismatch/kl" in record else {}  # 4 figures
    timing = record.get("timing", {})
    took = max(timing.get("iteration", 0.0), timing.get("cycle") or 0.0)
    checkpoint_s = checkpoint.save_seconds if checkpoint is not None else None
    return format_progress(
        {
            **{k: round(record[k], 4) for k in keys},
            **gap,
            "iteration": record["iteration"],
            "iterations": iterations,
            "checkpoint": checkpoint.iteration if checkpoint is not None else None,
            **({ITERATION_S: round(took, 2)} if timing else {}),
            **({CHECKPOINT_S: round(checkpoint_s, 2)} if checkpoint_s is not None else {}),
            **(
                {CHECKPOINT_ESTIMATE_S: round(checkpoint_estimate_s, 2)}
                if checkpoint_s is None and checkpoint_estimate_s is not None
                else {}
            ),
            **evaluation_headline(last_evaluation),
        }
    )


def progress_bar(total: int, initial: int, *, enabled: bool, desc: str):
    """The run's progress bar for people (tqdm), off where the operator reads progress lines instead."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="it", disable=not enabled, dynamic_ncols=True)


def iteration_records(records: list[dict]) -> list[dict]:
    """`records` but iteration 0 (the initial policy's evaluation)."""
    return [r for r in records if r["iteration"] > 0]


def last_evaluation(records: list[dict]) -> dict | None:
    """The newest record that holds an evaluation's val/ metrics, or None."""
    return next((r for r in reversed(records) if val_metrics(r)), None)


def bar_figures(record: dict[str, Any], last_evaluation: dict[str, Any] | None) -> dict[str, str]:
    """A record's figures on the progress bar: the headline metric, KL, throughput and, once the job
    evaluated, the last held-out reward."""
    key = headline_key(record)
    val = {"val": f"{last_evaluation['val/reward']:.3f}"} if last_evaluation else {}
    return {
        key: f"{record[key]:.3f}",
        "kl": f"{record['kl']:.4f}",
        "tps": f"{record['tokens_per_s_per_device']:.0f}",
        **val,
    }


def plot_progress(records: list[dict[str, Any]], path: Path) -> None:
    """progress_figure(records) as a PNG at `path`."""
    import matplotlib.pyplot as plt

    fig = progress_figure(records)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def progress_figure(records: list[dict[str, Any]]):
    """Reward (DPO: preference accuracy) with the held-out evaluation's reward and accuracy, the
    policy's entropy and throughput per iteration, each stage's `mfu/` and the rollout's `mbu/` where
    the records have them, the train-inference gap (`mismatch/kl`, log scale) where the job measures it,
    and a multi-turn job's turns, tool calls and tool errors per episode; the shared iteration axis has
    whole-number ticks only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # Iteration 0 (the initial policy's evaluation, docs/evaluation.md) has val/ metrics only.
    trained = [r for r in records if "tokens_per_s_per_device" in r]
    evaluated = [r for r in records if "val/reward" in r]
    iterations = [r["iteration"] for r in trained]
    agentic = [r for r in trained if "agent" in r]  # multi-turn jobs: a panel of their tool use
    utilisation = sorted({key for r in trained for key in r if key.startswith(("mfu/", "mbu/"))})
    gap = [r for r in trained if "mismatch/kl" in r]  # algorithm.rollout_correction, monitoring.mismatch
    num_panels = 3 + bool(utilisation) + bool(gap) + bool(agentic)
    fig, axes = plt.subplots(num_panels, 1, figsize=(7, 2.5 * num_panels + 0.5), sharex=True)
    ax_reward, ax_entropy, ax_tps = axes[:3]
    key = headline_key(trained[0]) if trained else "reward_mean"
    ax_reward.plot(iterations, [r[key] for r in trained], marker=".", label="training (sampled)")
    ax_reward.set_ylabel("mean reward" if key == "reward_mean" else "policy preference accuracy")
    if evaluated:
        val_iterations = [r["iteration"] for r in evaluated]
        ax_reward.plot(
            val_iterations, [r["val/reward"] for r in evaluated], marker="o", color="tab:red", label="held-out reward"
        )
        ax_reward.plot(
            val_iterations,
            [r["val/accuracy"] for r in evaluated],
            marker="s",
            linestyle="--",
            color="tab:purple",
            label="held-out accuracy",
        )
        ax_reward.legend(loc="best", fontsize="small")
    ax_reward.grid(alpha=0.3)
    # Records written before `entropy` was logged (a run resumed across versions) have none.
    with_entropy = [r for r in trained if "entropy" in r]
    ax_entropy.plot(
        [r["iteration"] for r in with_entropy], [r["entropy"] for r in with_entropy], marker=".", color="tab:green"
    )
    ax_entropy.set_ylabel("policy entropy (nats/token)")
    ax_entropy.grid(alpha=0.3)
    ax_tps.plot(iterations, [r["tokens_per_s_per_device"] for r in trained], marker=".", color="tab:orange")
    ax_tps.set_ylabel("tokens/s per device")
    ax_tps.grid(alpha=0.3)
    if utilisation:  # each stage's share of the device's peak (utilisation.py)
        ax_utilisation = axes[3]
        for key in utilisation:
            with_key = [r for r in trained if key in r]
            ax_utilisation.plot([r["iteration"] for r in with_key], [r[key] for r in with_key], marker=".", label=key)
        ax_utilisation.set_ylabel("fraction of peak")
        ax_utilisation.legend(loc="best", fontsize="small")
        ax_utilisation.grid(alpha=0.3)
    if gap:  # spans 1e-14 (float32 kernels) to 1e-2 (a gap to correct): a log axis, 0 left out
        ax_gap = axes[3 + bool(utilisation)]
        shown = [r for r in gap if r["mismatch/kl"] > 0]
        ax_gap.plot([r["iteration"] for r in shown], [r["mismatch/kl"] for r in shown], marker=".", color="tab:brown")
        ax_gap.set_yscale("log")
        ax_gap.set_ylabel("mismatch/kl (engine vs trainer)")
        ax_gap.grid(alpha=0.3)
    if agentic:
        ax_agent = axes[-1]
        steps = [r["iteration"] for r in agentic]
        for key, label in (
            ("turns_mean", "turns"),
            ("tool_calls_mean", "tool calls"),
            ("tool_errors_mean", "tool errors"),
        ):
            ax_agent.plot(steps, [r["agent"][key] for r in agentic], marker=".", label=label)
        ax_agent.set_ylabel("per episode")
        ax_agent.legend(loc="best", fontsize="small")
        ax_agent.grid(alpha=0.3)
    axes[-1].set_xlabel("iteration")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole: no 1.5 ticks
    fig.tight_layout()
    return fig


# shared_*: of those requests, the ones a worker on the warehouse's node served itself in shared memory.
_WAREHOUSE_COUNTERS = (
    "bytes_in",
    "bytes_out",
    "write_requests",
    "read_requests",
    "shared_write_requests",
    "shared_read_requests",
)
# stale_*: samples the staleness bound (dock.max_staleness) discarded, and policy updates it held.
_CONTROLLER_COUNTERS = (
    "requests",
    "samples_handed_out",
    "mark_ready_calls",
    "metadata_bytes",
    "stale_dropped",
    "stale_waits",
)


def dock_traffic(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Per-iteration dock traffic from two cumulative `TransferDock.stats()` snapshots."""

    def diff(new: dict, old: dict | None, keys: tuple[str, ...]) -> dict:
        return {k: new[k] - (old[k] if old else 0) for k in keys}

    old_warehouses = before["warehouses"] if before else [None] * len(after["warehouses"])
    old_controllers = before["controllers"] if before else {}
    return {
        "warehouses": [
            {"node_id": new.get("node_id"), **diff(new, old, _WAREHOUSE_COUNTERS)}
            for new, old in zip(after["warehouses"], old_warehouses)
        ],
        "controllers": {
            state: diff(new, old_controllers.get(state), _CONTROLLER_COUNTERS)
            for state, new in after["controllers"].items()
        },
    }
