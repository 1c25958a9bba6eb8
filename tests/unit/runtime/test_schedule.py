"""The order of an iteration's calls in each schedule, with workers, a feed, bookkeeping and banks
that record them:
the run-ahead queues the next iteration before this one's update (Ray runs one actor's calls in
submission order), and partial rollout launches the held states after that update."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
import torch
from tensordict import TensorDict

from rldock.runtime.algorithms.recipes import get_recipe
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.sampling import DriverBatch
from rldock.runtime.schedule import Driver, RunAheadSchedule, SyncSchedule
from rldock.runtime.states import StageCall

RECIPE = get_recipe("grpo")
BEFORE, UPDATES = ("rollout", "actor_inference", "reference", "reward", "advantage"), ("update",)
GROUP_SIZE, ROUND_TOKENS = 2, 16
ALGO = None  # read by sampling rounds only, which GRPO has not


@pytest.fixture(scope="module", autouse=True)
def ray_session() -> Iterator[None]:
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


class BankDouble:
    """A dock bank that logs the driver's calls to it."""

    states: dict = {}

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def reset(self) -> None:
        self.log.append(("reset", self.name))

    def put_groups(self, groups, shared, samples=None) -> None:
        self.log.append(("put", self.name, len(groups)))

    def set_policy_version(self, version: int) -> None:
        self.log.append(("policy", self.name, version))

    def get(self, state: str, columns, *, batch_size: int):
        """The driver's read of the samples' facts: logged, and the double holds none (None: exhausted)."""
        self.log.append(("read", self.name, state))


def stage_result() -> StageResult:
    return StageResult()


class WorkersDouble:
    """The attempt's workers (attempt.WorkerGroups): logs each launch, every rank returns at once."""

    def __init__(self, log: list) -> None:
        self.log = log

    def launch(self, call: StageCall, specs) -> dict[str, list]:
        states = tuple(spec.name for spec in specs)
        if states == ("rollout_resume",):  # partial rollout's second round, on the engines
            self.log.append(("finish_rollout", call.iteration))
        else:
            self.log.append(("launch", call.iteration, states, call.round_tokens))
        return {state: [ray.put(stage_result())] for state in states}

    def skip_turns(self, iteration: int, states: list[str]) -> None:
        pass


class FeedDouble:
    """The job's feed (sampling.Feed): logs each draw; its position is the log's length."""

    def __init__(self, log: list) -> None:
        self.log, self.draws = log, iter(range(100))

    def draw(self, num_prompts=None) -> DriverBatch:
        self.log.append(("draw", next(self.draws)))
        return DriverBatch(
            TensorDict({"prompt_ids": torch.zeros(2 * GROUP_SIZE, 3)}, batch_size=[2 * GROUP_SIZE]),
            prompt_lengths=[3, 3],
        )

    def state_dict(self) -> dict:
        return {"drawn": len(self.log)}


class BooksDouble:
    """The bookkeeping (bookkeeping.Bookkeeper) run inline, logging each call; counters always in."""

    def __init__(self, log: list) -> None:
        self.log = log

    def later(self, fn, *args):
        self.log.append(("later", fn.__name__))
        return fn(*args)

    def wait(self) -> None:
        pass


def recording_driver(tmp_path, log: list) -> Driver:
    books = BooksDouble(log)
    driver = Driver(
        recipe=RECIPE,
        output_dir=tmp_path,
        group_size=GROUP_SIZE,
        workers=WorkersDouble(log),
        feed=FeedDouble(log),
        books=books,
        counters=books,
    )
    assert (driver.before_update, driver.updates) == (BEFORE, UPDATES)
    return driver


def banks_of(log: list, count: int) -> DockBanks:
    return DockBanks([BankDouble(f"bank{i}", log) for i in range(count)])


def test_sync_runs_each_iteration_whole_and_bounds_staleness_in_the_bookkeeping_order(tmp_path):
    log: list = []
    schedule = SyncSchedule(recording_driver(tmp_path, log), banks_of(log, 1), algo=ALGO)
    stages = schedule.run(1)
    assert log == [
        ("draw", 0),
        ("reset", "bank0"),
        ("put", "bank0", 2),
        ("launch", 1, BEFORE, None),
        ("launch", 1, UPDATES, None),
        ("read", "bank0", "sample_facts"),  # once the stages are done, before the bank moves on
        ("later", "advance_policy"),
        ("policy", "bank0", 1),
    ]
    assert set(stages.results) == {*BEFORE, *UPDATES} and stages.bank is schedule.banks.bank(1)


def test_run_ahead_queues_the_next_iteration_before_the_update(tmp_path):
    log: list = []
    schedule = RunAheadSchedule(
        recording_driver(tmp_path, log), banks_of(log, 2), algo=ALGO, iterations=3, round_tokens=ROUND_TOKENS
    )
    schedule.run(1)
    assert log == [
        ("draw", 0),
        ("reset", "bank1"),
        ("put", "bank1", 2),
        ("launch", 1, BEFORE, None),
        ("draw", 1),
        ("reset", "bank0"),
        ("put", "bank0", 2),
        ("launch", 2, BEFORE, ROUND_TOKENS),
        ("launch", 1, UPDATES, None),
        ("read", "bank1", "sample_facts"),
        ("policy", "bank0", 1),
        ("policy", "bank1", 1),
    ]
    # a checkpoint after iteration 1 keeps the sampler from before iteration 2's draw
    assert schedule.checkpoint_sampler_state() == {"drawn": 4}
    del log[:]
    schedule.run(2)  # already put and launched: only the next run-ahead and the update
    assert [entry[:3] for entry in log if entry[0] == "launch"] == [("launch", 3, BEFORE), ("launch", 2, UPDATES)]
    del log[:]
    schedule.run(3)  # the last iteration runs nothing ahead
    assert log == [
        ("launch", 3, UPDATES, None),
        ("read", "bank1", "sample_facts"),
        ("policy", "bank0", 3),
        ("policy", "bank1", 3),
    ]


def test_partial_rollout_launches_the_held_states_after_the_update_that_cut_the_generation(tmp_path):
    log: list = []
    schedule = RunAheadSchedule(
        recording_driver(tmp_path, log),
        banks_of(log, 2),
        algo=ALGO,
        iterations=2,
        round_tokens=ROUND_TOKENS,
        actor_rank_states={"actor_inference"},
    )
    schedule.run(1)
    launches = [entry for entry in log if entry[0] in ("launch", "finish_rollout")]
    assert launches == [
        ("launch", 1, BEFORE, None),
        ("launch", 2, ("rollout", "reference", "reward", "advantage"), ROUND_TOKENS),
        ("launch", 1, UPDATES, None),
        ("finish_rollout", 2),
        ("launch", 2, ("actor_inference",), None),
    ]
    stages = schedule.run(2)
    assert "rollout_resume" in stages.results and "actor_inference" in stages.results
