"""Per-iteration metrics: the metrics.jsonl log (resume-safe), the throughput formula and the plot."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rldock.contract.progress import headline_key  # noqa: F401  (re-exported: callers read it with the metrics)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "progress.png"


def tokens_per_s_per_device(*, num_prompts: int, num_responses: int, prompt_length: float,
                            response_length: float, num_devices: int, seconds: float) -> float:
    """The MindSpeed RL paper's throughput T = G*N*(PL+SL)/ND/ETE, in tokens/s per device.

    PL and SL are the iteration's mean prompt and response lengths (tokens actually processed, not
    the configured maxima) and ETE the end-to-end seconds of the iteration.
    """
    if seconds <= 0 or num_devices <= 0:
        raise ValueError("seconds and num_devices must be positive")
    return num_prompts * num_responses * (prompt_length + response_length) / num_devices / seconds


class MetricsLog:
    """metrics.jsonl with one JSON object per finished iteration, never holding an iteration twice."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / METRICS_FILE

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


def plot_progress(records: list[dict[str, Any]], path: Path) -> None:
    """Reward (DPO: preference accuracy) with the held-out evaluation's reward and accuracy, the
    policy's entropy and throughput per iteration, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Iteration 0 (the initial policy's evaluation, docs/evaluation.md) has val/ metrics only.
    trained = [r for r in records if "tokens_per_s_per_device" in r]
    evaluated = [r for r in records if "val/reward" in r]
    iterations = [r["iteration"] for r in trained]
    fig, (ax_reward, ax_entropy, ax_tps) = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    key = headline_key(trained[0]) if trained else "reward_mean"
    ax_reward.plot(iterations, [r[key] for r in trained], marker=".", label="training (sampled)")
    ax_reward.set_ylabel("mean reward" if key == "reward_mean" else "policy preference accuracy")
    if evaluated:
        val_iterations = [r["iteration"] for r in evaluated]
        ax_reward.plot(val_iterations, [r["val/reward"] for r in evaluated], marker="o", color="tab:red",
                       label="held-out reward")
        ax_reward.plot(val_iterations, [r["val/accuracy"] for r in evaluated], marker="s", linestyle="--",
                       color="tab:purple", label="held-out accuracy")
        ax_reward.legend(loc="best", fontsize="small")
    ax_reward.grid(alpha=0.3)
    # Records written before `entropy` was logged (a run resumed across versions) have none.
    with_entropy = [r for r in trained if "entropy" in r]
    ax_entropy.plot([r["iteration"] for r in with_entropy], [r["entropy"] for r in with_entropy], marker=".",
                    color="tab:green")
    ax_entropy.set_ylabel("policy entropy (nats/token)")
    ax_entropy.grid(alpha=0.3)
    ax_tps.plot(iterations, [r["tokens_per_s_per_device"] for r in trained], marker=".", color="tab:orange")
    ax_tps.set_ylabel("tokens/s per device")
    ax_tps.set_xlabel("iteration")
    ax_tps.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# shared_*: of those requests, the ones a worker on the warehouse's node served itself in shared memory.
_WAREHOUSE_COUNTERS = ("bytes_in", "bytes_out", "write_requests", "read_requests", "shared_write_requests",
                       "shared_read_requests")
# stale_*: samples the staleness bound (dock.max_staleness) discarded, and policy updates it held.
_CONTROLLER_COUNTERS = ("requests", "samples_handed_out", "mark_ready_calls", "metadata_bytes",
                        "stale_dropped", "stale_waits")


def dock_traffic(before: dict[str, Any] | None, after: dict[str, Any]) -> dict[str, Any]:
    """Per-iteration dock traffic from two cumulative `TransferDock.stats()` snapshots."""

    def diff(new: dict, old: dict | None, keys: tuple[str, ...]) -> dict:
        return {k: new[k] - (old[k] if old else 0) for k in keys}

    old_warehouses = before["warehouses"] if before else [None] * len(after["warehouses"])
    old_controllers = before["controllers"] if before else {}
    return {
        "warehouses": [{"node_id": new.get("node_id"), **diff(new, old, _WAREHOUSE_COUNTERS)}
                       for new, old in zip(after["warehouses"], old_warehouses)],
        "controllers": {state: diff(new, old_controllers.get(state), _CONTROLLER_COUNTERS)
                        for state, new in after["controllers"].items()},
    }
