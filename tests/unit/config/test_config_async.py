"""Config rules for asynchronous training (training.mode: async)."""

from pathlib import Path

import pytest
import yaml

from rldock.config import ConfigError, parse_job_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def demo_data() -> dict:
    data = yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())
    data["training"]["mode"] = "async"
    data["dock"]["max_staleness"] = 1
    return data


def problems(data: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_job_config(data)
    return [p.path for p in caught.value.problems]


def test_sync_is_the_default_and_async_grpo_is_valid(demo_data):
    assert parse_job_config(yaml.safe_load((EXAMPLES / "grpo-tiny.yaml").read_text())).training.mode == "sync"
    assert parse_job_config(demo_data).training.mode == "async"


@pytest.mark.parametrize(
    "training",
    [
        {"strategy": "fsdp"},
        {"strategy": "fsdp", "resharding": "allgather_swap"},
        {"tensor_parallel_size": 2, "data_parallel_size": 2},
        {"resharding": "allgather_swap"},
    ],
)
def test_async_runs_on_any_training_layout(demo_data, training):
    """Sharded, split or swapped ranks run the pipeline: each rank runs its queued calls in order, so their
    collectives line up, and the update brings the training state back wherever the last export left it."""
    demo_data["training"].update(training)
    assert parse_job_config(demo_data).training.mode == "async"


def test_the_moe_example_runs_async_on_its_fsdp_x_ep_ranks():
    data = yaml.safe_load((EXAMPLES / "grpo-tiny-moe.yaml").read_text())
    data["training"]["mode"], data["dock"]["max_staleness"] = "async", 1
    assert parse_job_config(data).training.expert_parallel_size == 2


@pytest.mark.parametrize(
    "change, path",
    [
        # samples one version old: the update's own forward pass is not the sampling policy
        ({"algorithm": {"recompute_old_logprobs": "never"}}, "algorithm.recompute_old_logprobs"),
    ],
)
def test_what_async_cannot_run_is_named(demo_data, change, path):
    for section, values in change.items():
        demo_data[section].update(values)
    assert path in problems(demo_data)


def test_async_without_running_ahead_may_skip_the_old_logprob_pass(demo_data):
    demo_data["dock"]["max_staleness"] = 0  # runs like sync: the sampling policy is the one training
    demo_data["algorithm"]["recompute_old_logprobs"] = "never"
    assert parse_job_config(demo_data).algorithm.recompute_old_logprobs == "never"


def test_async_refuses_dapo(demo_data):
    demo_data["algorithm"]["name"] = "dapo"
    assert "training.mode" in problems(demo_data)
