"""The checkpoint naming both programs share."""

import pytest

from rldock.contract.checkpoints import checkpoint_name, checkpoint_path, iteration_of


@pytest.mark.parametrize("iteration", [0, 7, 123456, 1234567])
def test_names_round_trip(iteration):
    assert iteration_of(checkpoint_name(iteration)) == iteration


@pytest.mark.parametrize("name", [".staging-iter-000001", "iter-", "iter-12a", "inflight-dock.pkl", "iter-000001.tmp"])
def test_other_names_are_not_checkpoints(name):
    assert iteration_of(name) is None


def test_path_is_posix_under_the_output_dir():
    assert checkpoint_path("/ckpt/ns/job", 12) == "/ckpt/ns/job/checkpoints/iter-000012"
