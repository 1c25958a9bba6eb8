"""The driver's records (driver/records.py): metrics.jsonl bookkeeping, the throughput formula, dock
traffic deltas and the progress plot."""

import json

import pytest

from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.records import (
    MetricsLog,
    dock_traffic,
    plot_progress,
    pool_metrics,
    tokens_per_s_per_device,
)


def test_throughput_is_the_papers_formula():
    # G=16, N=8, PL=5, SL=3, 2 devices, 4 s: 16*8*8/2/4 = 128 tokens/s per device
    assert tokens_per_s_per_device(
        num_prompts=16, num_responses=8, prompt_length=5, response_length=3, num_devices=2, seconds=4.0
    ) == pytest.approx(128.0)
    with pytest.raises(ValueError):
        tokens_per_s_per_device(
            num_prompts=1, num_responses=1, prompt_length=1, response_length=1, num_devices=1, seconds=0
        )


def test_metrics_log_truncates_redone_iterations_and_torn_lines(tmp_path):
    log = MetricsLog(tmp_path)
    for i in range(1, 5):
        log.append({"iteration": i, "reward_mean": i / 10})
    with log.path.open("a") as f:
        f.write('{"iteration": 5, "rew')  # killed mid-write
    assert [r["iteration"] for r in log.read()] == [1, 2, 3, 4]
    kept = log.truncate_after(2)
    assert [r["iteration"] for r in kept] == [1, 2]
    log.append({"iteration": 3, "reward_mean": 0.0})
    assert [json.loads(line)["iteration"] for line in log.path.read_text().splitlines()] == [1, 2, 3]


def test_dock_traffic_is_the_difference_of_cumulative_counters():
    def stats(bytes_in, handed):
        return {
            "warehouses": [
                {
                    "node_id": "n1",
                    "bytes_in": bytes_in,
                    "bytes_out": 2 * bytes_in,
                    "write_requests": 1,
                    "read_requests": 2,
                    "shared_write_requests": 1,
                    "shared_read_requests": 0,
                    "capacity": 16,
                }
            ],
            "controllers": {
                "reward": {
                    "requests": 3,
                    "samples_handed_out": handed,
                    "mark_ready_calls": 4,
                    "metadata_bytes": 100,
                    "wait_s": 1.0,
                    "stale_dropped": handed // 8,
                    "stale_waits": 1,
                }
            },
        }

    first = dock_traffic(None, stats(100, 16))
    assert first["warehouses"][0] == {
        "node_id": "n1",
        "bytes_in": 100,
        "bytes_out": 200,
        "write_requests": 1,
        "read_requests": 2,
        "shared_write_requests": 1,
        "shared_read_requests": 0,
    }
    second = dock_traffic(stats(100, 16), stats(250, 32))
    assert second["warehouses"][0]["bytes_in"] == 150
    assert second["controllers"]["reward"]["samples_handed_out"] == 16
    assert second["controllers"]["reward"]["requests"] == 0
    assert (second["controllers"]["reward"]["stale_dropped"], second["controllers"]["reward"]["stale_waits"]) == (2, 0)


def test_progress_plot_shows_entropy_and_tolerates_records_without_it(tmp_path, saved):
    base = {"reward_mean": 0.5, "tokens_per_s_per_device": 10.0}
    records = [
        {"iteration": 1, **base},
        {"iteration": 2, **base, "entropy": 1.5},
        {"iteration": 3, **base, "entropy": 1.25},
    ]
    plot_progress(records, tmp_path / "progress.png")
    assert (tmp_path / "progress.png").stat().st_size > 0
    panels = {ax.get_ylabel(): ax.lines[0] for ax in saved[0].axes}
    entropy = panels["policy entropy (nats/token)"]
    assert list(entropy.get_xdata()) == [2, 3] and list(entropy.get_ydata()) == [1.5, 1.25]


@pytest.fixture
def saved(monkeypatch) -> list:
    """The figures plot_progress saves, in order (each still written to its file)."""
    from matplotlib.figure import Figure

    figures: list = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), real_savefig(fig, *a, **k))[1])
    return figures


def test_progress_plot_draws_the_held_out_curve_from_iteration_0(tmp_path, saved):
    base = {"reward_mean": 0.5, "tokens_per_s_per_device": 10.0}
    records = [
        {"iteration": 0, "val/reward": 0.1, "val/accuracy": 0.0},  # the initial policy: val/ only
        {"iteration": 1, **base},
        {"iteration": 2, **base, "val/reward": 0.3, "val/accuracy": 0.25},
    ]
    plot_progress(records, tmp_path / "progress.png")
    reward_axis = next(ax for ax in saved[0].axes if ax.get_ylabel() == "mean reward")
    lines = {line.get_label(): line for line in reward_axis.lines}
    assert list(lines["training (sampled)"].get_xdata()) == [1, 2]
    assert list(lines["held-out reward"].get_xdata()) == [0, 2]
    assert list(lines["held-out reward"].get_ydata()) == [0.1, 0.3]
    assert list(lines["held-out accuracy"].get_ydata()) == [0.0, 0.25]


def test_progress_plot_has_a_tool_use_panel_for_multi_turn_jobs(tmp_path, saved):
    base = {"reward_mean": 0.5, "tokens_per_s_per_device": 10.0}
    agent = {"turns_mean": 2.0, "tool_calls_mean": 1.0, "tool_errors_mean": 0.25}
    records = [
        {"iteration": 1, **base, "agent": agent},
        {"iteration": 2, **base, "agent": {**agent, "turns_mean": 3.0}},
    ]
    plot_progress(records, tmp_path / "progress.png")
    panel = next(ax for ax in saved[0].axes if ax.get_ylabel() == "per episode")
    lines = {line.get_label(): list(line.get_ydata()) for line in panel.lines}
    assert lines == {"turns": [2.0, 3.0], "tool calls": [1.0, 1.0], "tool errors": [0.25, 0.25]}
    plot_progress([{"iteration": 1, **base}], tmp_path / "single.png")  # single-turn jobs: three panels
    assert len(saved[1].axes) == 3


def test_progress_plot_draws_each_stage_utilisation(tmp_path, saved):
    base = {"reward_mean": 0.5, "tokens_per_s_per_device": 10.0}
    records = [
        {"iteration": 1, **base},  # a record from before the metrics were logged: left out of the panel
        {"iteration": 2, **base, "mfu/update": 0.4, "mfu/rollout": 0.05, "mbu/rollout": 0.2},
        {"iteration": 3, **base, "mfu/update": 0.5, "mfu/rollout": 0.06, "mbu/rollout": 0.3},
    ]
    plot_progress(records, tmp_path / "progress.png")
    panel = next(ax for ax in saved[0].axes if ax.get_ylabel() == "fraction of peak")
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in panel.lines}
    assert lines == {
        "mbu/rollout": ([2, 3], [0.2, 0.3]),
        "mfu/rollout": ([2, 3], [0.05, 0.06]),
        "mfu/update": ([2, 3], [0.4, 0.5]),
    }


def test_progress_plot_draws_the_train_inference_gap_where_the_job_measures_it(tmp_path, saved):
    base = {"reward_mean": 0.5, "tokens_per_s_per_device": 10.0}
    agent = {"turns_mean": 2.0, "tool_calls_mean": 1.0, "tool_errors_mean": 0.25}
    records = [
        {"iteration": 1, **base, "mismatch/kl": 3e-14, "agent": agent},
        {"iteration": 2, **base, "mismatch/kl": 0.0, "agent": agent},  # no token measured: off the log axis
        {"iteration": 3, **base, "mismatch/kl": 6e-6, "agent": agent},
    ]
    plot_progress(records, tmp_path / "progress.png")
    labels = [ax.get_ylabel() for ax in saved[0].axes]
    assert labels[-2:] == ["mismatch/kl (engine vs trainer)", "per episode"]  # above the tool-use panel
    (line,) = saved[0].axes[-2].lines
    assert (list(line.get_xdata()), list(line.get_ydata())) == ([1, 3], [3e-14, 6e-6])
    assert saved[0].axes[-2].get_yscale() == "log"
    plot_progress([{"iteration": 1, **base}], tmp_path / "unmeasured.png")
    assert "mismatch/kl (engine vs trainer)" not in [ax.get_ylabel() for ax in saved[1].axes]


@pytest.mark.parametrize("num_iterations", [2, 3, 7, 40])
def test_progress_plot_ticks_whole_iterations_only(num_iterations):
    import matplotlib.pyplot as plt

    from rldock.runtime.driver.records import progress_figure

    base = {"reward_mean": 0.5, "tokens_per_s_per_device": 10.0, "entropy": 1.0}
    fig = progress_figure([{"iteration": i, **base} for i in range(1, num_iterations + 1)])
    ticks = fig.axes[-1].get_xticks()
    plt.close(fig)
    assert len(ticks) >= 2 and all(float(tick).is_integer() for tick in ticks), ticks


def test_the_progress_plot_is_drawn_again_only_when_records_came(tmp_path, saved):
    log = MetricsLog(tmp_path)
    base = {"reward_mean": 0.5, "tokens_per_s_per_device": 10.0}
    for iteration in (1, 2):
        log.append({"iteration": iteration, **base})
    assert [r["iteration"] for r in log.draw()] == [1, 2]  # a checkpoint's
    log.draw()  # the end of the run just after it
    assert len(saved) == 1 and (tmp_path / "progress.png").stat().st_size > 0
    log.append({"iteration": 3, **base})
    log.draw()
    assert len(saved) == 2


def test_a_drawing_that_fails_is_logged_and_the_records_still_returned(tmp_path, monkeypatch, caplog):
    import rldock.runtime.driver.records as records_module

    def broken(records, path):
        raise ValueError("no font")

    monkeypatch.setattr(records_module, "plot_progress", broken)
    log = MetricsLog(tmp_path)
    log.append({"iteration": 1, "reward_mean": 0.5, "tokens_per_s_per_device": 10.0})
    assert [r["iteration"] for r in log.draw()] == [1]
    assert "not drawn from 1 records" in caplog.text and "no font" in caplog.text


def test_the_pools_metrics_count_each_engines_samples_and_its_last_load():
    """Two results of engine 1 (its own call and one that replaced dead engine 0's), one of engine 2, an actor
    rank's engine beside them (no `pool_samples`): samples by engine, the slowest load, rank 0's copy."""
    rollouts = [
        StageResult(
            num_samples=4,
            metrics={"pool_samples": {"engine1": 4}, "pool_weights_load_s": 0.25, "pool_publish_copy_s": 0.5},
        ),
        StageResult(num_samples=2, metrics={"pool_samples": {"engine1": 2}}),
        StageResult(
            num_samples=8,
            metrics={"pool_samples": {"engine2": 8}, "pool_weights_load_s": 0.75, "pool_publish_copy_s": 0.5},
        ),
        StageResult(num_samples=16, metrics={}),
    ]
    assert pool_metrics(rollouts) == {
        "rollout/pool_samples": 14,
        "rollout/pool_engine_samples": {"engine1": 6, "engine2": 8},
        "rollout/pool_weights_load_s": 0.75,
        "rollout/pool_publish_copy_s": 0.5,
    }
    assert pool_metrics(rollouts[1:2]) == {"rollout/pool_samples": 2, "rollout/pool_engine_samples": {"engine1": 2}}
    assert pool_metrics(rollouts[3:]) == {}  # no pool
