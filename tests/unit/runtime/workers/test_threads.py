"""The per-worker CPU thread budget: an equal share of the node's cores per compute worker."""

from __future__ import annotations

import pytest
import torch

from rldock.config.job import JobConfig
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.workers.threads import apply_thread_budget, compute_workers_per_node, thread_share


@pytest.mark.parametrize(
    "cores, processes, share",
    [
        (2, 4, 1),
        (2, 1, 2),
        (16, 4, 4),
        (16, 3, 5),
        (1, 1, 1),
        (8, 0, 8),
        (3, 2, 1),
    ],
)
def test_thread_share_is_an_equal_share_and_at_least_one(cores, processes, share):
    assert thread_share(cores, processes) == share


def _cfg(name="grpo", *, kl_coef=0.04, dp=1, tp=1, nodes=1, num_threads=None, reward=None) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "/m"},
        **({"reward": reward} if reward else {}),
        training={"data_parallel_size": dp, "tensor_parallel_size": tp, "num_threads": num_threads},
        resources={"num_nodes": nodes},
        algorithm={
            "name": name,
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 4,
            "max_response_length": 4,
            "learning_rate": 1e-3,
            "kl_coef": kl_coef,
        },
    )


@pytest.mark.parametrize(
    "cfg, workers",
    [
        (_cfg(dp=2), 4),  # two actor and two reference ranks
        (_cfg(dp=2, kl_coef=0.0), 2),  # no reference ranks
        (_cfg(dp=2, tp=2), 6),  # four actor ranks (TP x DP), two reference ranks
        (_cfg("ppo"), 3),  # actor, reference, critic
        (_cfg("ppo", dp=2), 6),  # a critic rank per data-parallel rank, like the references
        (_cfg(reward={"terms": [{"name": "model", "path": "/rm"}]}), 3),  # actor, reference, reward model
        (_cfg(dp=2, kl_coef=0.0, reward={"terms": [{"name": "model", "path": "/rm"}]}), 3),
        (_cfg(dp=2, nodes=2), 2),  # spread over two nodes
    ],
)
def test_compute_workers_per_node_counts_the_ranks_the_flow_starts(cfg, workers):
    assert compute_workers_per_node(cfg, job_recipe(cfg)) == workers


def _budget(cfg: JobConfig, device_kind: str) -> int | None:
    return apply_thread_budget(cfg, job_recipe(cfg), device_kind=device_kind, role="test")


def test_budget_sets_torch_threads_on_cpu_only_and_not_when_switched_off():
    before = torch.get_num_threads()
    try:
        assert _budget(_cfg(num_threads=0), "cpu") is None
        assert torch.get_num_threads() == before
        assert _budget(_cfg(num_threads=3), "npu") is None
        assert _budget(_cfg(num_threads=3), "cpu") == 3
        assert torch.get_num_threads() == 3
        assert (_budget(_cfg(), "cpu") or 0) >= 1
    finally:
        torch.set_num_threads(before)
