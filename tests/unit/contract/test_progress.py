from rldock.contract.progress import PREFIX, format_progress, last_progress


def test_round_trip_and_last_record_wins():
    lines = [
        "noise",
        format_progress({"iteration": 1, "reward_mean": 0.2}),
        "(ActorWorker pid=1) other",
        "prefix " + format_progress({"iteration": 2, "reward_mean": 0.3}),
        PREFIX + '{"iteration": 3, "rew',
    ]  # torn
    assert last_progress(lines) == {"iteration": 2, "reward_mean": 0.3}


def test_no_progress_yet():
    assert last_progress(["starting", PREFIX + "[1, 2]"]) is None


def test_the_last_evaluation_rides_on_the_progress_line():
    from rldock.contract.progress import evaluation_headline

    assert evaluation_headline(None) == {}
    record = {"iteration": 4, "reward_mean": 0.5, "val/reward": 0.123456, "val/accuracy": 0.25}
    headline = evaluation_headline(record)
    assert headline == {"val_iteration": 4, "val_reward": 0.1235, "val_accuracy": 0.25}
    assert last_progress([format_progress({"iteration": 5, **headline})])["val_reward"] == 0.1235
