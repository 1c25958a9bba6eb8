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
    assert not any(ckpt.staging_dir(tmp_path, 8).iterdir())


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
