"""The checkpoint layout (runtime/checkpoint.py): commits are atomic and pruned, and an iteration's
in-flight dock is kept for its retry only."""

from rldock.runtime import checkpoint as ckpt


def test_checkpoints_commit_atomically_and_prune(tmp_path):
    for iteration in (2, 4, 6):
        staging = ckpt.staging_dir(tmp_path, iteration)
        (staging / "optimizer.pt").write_bytes(b"x")
        ckpt.commit(tmp_path, staging, iteration, {"sampler": {"epoch": iteration}}, keep_last=2)
    assert [c.iteration for c in ckpt.list_checkpoints(tmp_path)] == [4, 6]
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest.iteration == 6 and latest.state() == {"sampler": {"epoch": 6}, "iteration": 6}
    # A save interrupted before commit is invisible and is cleared by the next attempt.
    staging = ckpt.staging_dir(tmp_path, 8)
    (staging / "optimizer.pt").write_bytes(b"partial")
    assert ckpt.latest_checkpoint(tmp_path).iteration == 6
    assert [p.name for p in ckpt.staging_dir(tmp_path, 8).iterdir()] == [ckpt.STARTED_FILE]  # a fresh save


def test_inflight_dock_is_kept_for_the_retry_of_its_iteration_only(tmp_path):
    import numpy as np

    assert ckpt.load_inflight(tmp_path, 3) is None
    dock = {"mode": "central", "consumer": np.arange(4)}
    ckpt.save_inflight(
        tmp_path,
        iteration=3,
        dock_state=dock,
        finished={"reward": [{"rewards": [1.0]}]},
        launched={"reward": 1, "rollout": 2},
    )
    assert ckpt.load_inflight(tmp_path, 4) is None  # a retry that starts elsewhere ignores it
    kept = ckpt.load_inflight(tmp_path, 3)
    assert kept["dock"]["consumer"].tolist() == [0, 1, 2, 3]
    assert (kept["finished"], kept["launched"]) == ({"reward": [{"rewards": [1.0]}]}, {"reward": 1, "rollout": 2})
    assert [p.name for p in ckpt.checkpoint_root(tmp_path).iterdir()] == [ckpt.INFLIGHT_FILE]  # no partial left
    ckpt.clear_inflight(tmp_path)
    ckpt.clear_inflight(tmp_path)  # twice is fine
    assert ckpt.load_inflight(tmp_path, 3) is None


def test_no_checkpoint_in_an_empty_dir(tmp_path):
    assert ckpt.latest_checkpoint(tmp_path) is None


def test_a_checkpoint_says_how_long_its_save_took_and_the_progress_line_what_a_stop_may_take(tmp_path, monkeypatch):
    """save.json's seconds (staging to commit), which the progress line carries beside the iteration's
    seconds (its cycle where longer): what a SIGTERM stop may take, held by the operator to the grace period."""
    import json

    from rldock.contract.progress import CHECKPOINT_ESTIMATE_S, CHECKPOINT_S, ITERATION_S, PREFIX
    from rldock.runtime.driver.records import progress_line

    clock = iter([1000.0, 1002.5])  # the save starts, then commits 2.5 s later
    monkeypatch.setattr(ckpt.time, "time", lambda: next(clock))
    saved = ckpt.commit(tmp_path, ckpt.staging_dir(tmp_path, 3), 3, {"sampler": {}}, keep_last=2)
    assert saved.save_seconds == 2.5 and not (saved.path / ckpt.STARTED_FILE).exists()
    record = {"iteration": 4, "reward_mean": 0.5, "kl": 0.0, "loss": 0.1, "response_length_mean": 3.0}
    record |= {"tokens_per_s_per_device": 10.0, "timing": {"iteration": 2.345, "cycle": 3.456}}
    figures = json.loads(progress_line(record, 10, saved, None).removeprefix(PREFIX))
    assert (figures["checkpoint"], figures[ITERATION_S]) == (3, 3.46)  # the cycle: longer than the iteration
    assert figures[CHECKPOINT_S] == 2.5
    older = ckpt.Checkpoint(saved.path, 3)
    (saved.path / ckpt.SAVE_FILE).unlink()  # saved before this was recorded
    assert older.save_seconds is None and CHECKPOINT_S not in progress_line(record, 10, older, None)
    # The driver's estimate of a save stands in before any was measured, and only then.
    estimated = json.loads(progress_line(record, 10, None, None, 1.234).removeprefix(PREFIX))
    assert estimated[CHECKPOINT_ESTIMATE_S] == 1.23 and CHECKPOINT_S not in estimated
    assert CHECKPOINT_ESTIMATE_S in progress_line(record, 10, older, None, 1.234)  # a save of unknown seconds
    (saved.path / ckpt.SAVE_FILE).write_text(json.dumps({"seconds": 2.5}))
    assert CHECKPOINT_ESTIMATE_S not in progress_line(record, 10, saved, None, 1.234)
