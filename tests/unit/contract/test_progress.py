from rldock.contract.progress import PREFIX, format_progress, last_progress


def test_round_trip_and_last_record_wins():
    lines = ["noise", format_progress({"iteration": 1, "reward_mean": 0.2}),
             "(ActorWorker pid=1) other", "prefix " + format_progress({"iteration": 2, "reward_mean": 0.3}),
             PREFIX + '{"iteration": 3, "rew']  # torn
    assert last_progress(lines) == {"iteration": 2, "reward_mean": 0.3}


def test_no_progress_yet():
    assert last_progress(["starting", PREFIX + "[1, 2]"]) is None
