"""Each worker group saves and restores its own part of a checkpoint, declared by its spec (flow/states.py:
`WorkerGroup.checkpoint`): the attempt iterates the recipe's groups and names none. A group added with a
checkpoint state is saved and restored with no change to the driver; its ranks' own states go into rng.pt
under its key and come back to the same ranks; a checkpoint lacking a group's files is refused by name."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rldock.config.job import JobConfig
from rldock.runtime.checkpoint import RANK_STATES_FILE, Checkpoint
from rldock.runtime.driver import attempt as attempt_module
from rldock.runtime.driver.attempt import Attempt, CheckpointMismatch, WorkerGroups
from rldock.runtime.flow.catalogue import RECIPES
from rldock.runtime.flow.columns import PROMPT, RESPONSE
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import CheckpointState, WorkerGroup, WorkerState, worker_groups


def _cfg(name: str) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "/m"},
        algorithm={
            "name": name,
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 4,
            "max_response_length": 4,
            "learning_rate": 1e-3,
        },
    )


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_groups_that_keep_a_checkpoint_state_have_its_two_methods(name):
    groups = worker_groups(job_recipe(_cfg(name)).specs)
    kept = {group.name for group in groups.values() if group.checkpoint is not None}
    assert kept == ({"actor", "critic"} if "critic" in groups else {"actor"})
    for group in groups.values():
        cls = group.worker_class()
        assert callable(getattr(cls, "restore", None)) == (group.checkpoint is not None), group.name
        if group.checkpoint is not None:
            assert callable(getattr(cls, "save", None)), group.name


class _Method:
    def __init__(self, log: list, rank: str, method: str):
        self.log, self.rank, self.method = log, rank, method

    def remote(self, *args):
        self.log.append((self.rank, self.method, args))
        return f"{self.rank} state" if self.method == "save" else None


class _Rank:
    """A Ray actor handle double of one rank: each call is recorded; `save` returns the rank's own state."""

    def __init__(self, log: list, name: str):
        self._log, self._name = log, name

    def __getattr__(self, method: str) -> _Method:
        return _Method(self._log, self._name, method)


TOY_STATE = CheckpointState(files=("toy.pt",), rank_states="toys")
TOY = WorkerState(
    "toy_score",
    WorkerGroup("toy", "tests:Toy", lambda ctx, rank, size: {}, checkpoint=TOY_STATE),
    method="score",
    consumes=PROMPT + RESPONSE,
    produces=("toy_score",),
)


@pytest.fixture
def attempt_and_log(monkeypatch, tmp_path):
    """A PPO attempt with a toy group that keeps a checkpoint state (one spec), on handle doubles, and the
    calls its ranks get."""
    cfg = _cfg("ppo")
    recipe = job_recipe(cfg)
    recipe = replace(recipe, specs=(*recipe.specs, TOY))
    attempt = Attempt(cfg, type("Inputs", (), {"recipe": recipe})(), output_dir=tmp_path, resume_from=None)
    log: list = []
    ranks = {"actor": 2, "reference": 1, "critic": 1, "reward": 1, "toy": 2}
    attempt.workers = WorkerGroups({g: [_Rank(log, f"{g} {r}") for r in range(n)] for g, n in ranks.items()})
    monkeypatch.setattr(attempt_module.ray, "get", lambda refs: refs)
    return attempt, log


def _checkpoint(path: Path, files=("policy", "optimizer.pt", "critic.pt", "critic_optimizer.pt", "toy.pt")):
    for name in files:
        (path / name).touch()
    return Checkpoint(path, 1)


def test_every_group_that_keeps_a_state_saves_in_the_recipe_s_order_and_its_ranks_states_go_into_rng_pt(
    attempt_and_log, tmp_path
):
    attempt, log = attempt_and_log
    attempt.save(tmp_path)
    staging = (str(tmp_path),)
    assert log == [
        ("actor 0", "save", staging),
        ("actor 1", "save", staging),
        ("critic 0", "save", staging),
        ("toy 0", "save", staging),
        ("toy 1", "save", staging),
    ]
    assert torch.load(tmp_path / RANK_STATES_FILE) == {
        "actors": ["actor 0 state", "actor 1 state"],
        "toys": ["toy 0 state", "toy 1 state"],
    }


def test_a_resume_hands_each_rank_its_own_state_back(attempt_and_log, tmp_path):
    attempt, log = attempt_and_log
    attempt.save(tmp_path)
    log.clear()
    attempt.restore(_checkpoint(tmp_path))
    path = str(tmp_path)
    assert log == [
        ("actor 0", "restore", (path, "actor 0 state")),
        ("actor 1", "restore", (path, "actor 1 state")),
        ("critic 0", "restore", (path, None)),
        ("toy 0", "restore", (path, "toy 0 state")),
        ("toy 1", "restore", (path, "toy 1 state")),
    ]


def test_a_checkpoint_without_a_group_s_files_is_refused_naming_them_before_any_device_is_reserved(
    attempt_and_log, tmp_path, monkeypatch
):
    attempt, log = attempt_and_log
    attempt.save(tmp_path)
    log.clear()
    attempt.resume_from = _checkpoint(tmp_path, files=("policy", "optimizer.pt", "toy.pt"))  # a GRPO run's, say

    def reserve(*args):
        raise AssertionError("devices reserved before the checkpoint was checked")

    monkeypatch.setattr(attempt_module.cluster, "job_placement", reserve)
    with pytest.raises(CheckpointMismatch, match="holds no critic.pt, critic_optimizer.pt, which the job's critic"):
        attempt._start()
    assert log == []  # nothing restored
