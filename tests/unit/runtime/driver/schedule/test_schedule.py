"""The order of an iteration's calls in each schedule, with workers, a feed, bookkeeping and banks
that record them:
the run-ahead queues the next iteration before this one's update (Ray runs one actor's calls in
submission order), partial rollout launches the held states after that update, and carried episodes'
prompts are handed ahead with an attempt's first iteration only."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import ray
import torch
from tensordict import TensorDict

from rldock.runtime.data import Row
from rldock.runtime.data.row_column import row_bytes
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.feed import DriverBatch
from rldock.runtime.driver.schedule import Driver, RunAheadSchedule, SyncSchedule
from rldock.runtime.driver.schedule.prompts_ahead import PromptsAhead
from rldock.runtime.flow.catalogue import get_recipe
from rldock.runtime.flow.states import StageCall

RECIPE = get_recipe("grpo")
BEFORE, UPDATES = ("rollout", "actor_inference", "reference", "reward", "advantage"), ("update",)
GROUP_SIZE, ROUND_TOKENS = 2, 16
ALGO = None  # read by sampling rounds only, which GRPO has not


@pytest.fixture(scope="module", autouse=True)
def ray_session(start_local_ray) -> Iterator[None]:
    with start_local_ray(num_cpus=1):
        yield


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

    def recover(self, ref, error: Exception) -> None:
        return None  # no worker of these doubles is replaced


class FeedDouble:
    """The job's feed (feed.Feed): logs each draw; its position is the log's length."""

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


class RoundWorkersDouble:
    """DAPO's sampling states on a real dock bank: each round's rollout writes its rows' responses
    (row r: r % 3 + 1 tokens) and the reward their scores, group by group from `scores`."""

    def __init__(self, bank, scores: list[list[float]]) -> None:
        self.bank, self.scores = bank, iter(scores)

    def recover(self, ref, error: Exception) -> None:
        return None  # no worker of these doubles is replaced

    def launch(self, call: StageCall, specs) -> dict[str, list]:
        states = tuple(spec.name for spec in specs)
        assert states == ("rollout", "reward"), states
        rows, _ = self.bank.get("rollout", ["prompt_ids"], batch_size=2 * GROUP_SIZE, whole_groups=True)
        lengths = rows % 3 + 1  # (k*N,)
        mask = (torch.arange(4)[None, :] < lengths[:, None]).long()  # (k*N, SL)
        responses = {"response_ids": mask * 7, "response_mask": mask, "response_length": lengths}
        versions = {"policy_version": torch.zeros(len(rows), dtype=torch.int64)}
        self.bank.put(rows, TensorDict({**responses, **versions}, batch_size=[len(rows)]))
        scored, _ = self.bank.get("reward", ["response_ids"], batch_size=2 * GROUP_SIZE)
        score = torch.tensor([s for group in next(self.scores) for s in group])  # (k*N,)
        self.bank.put(scored, TensorDict({"reward": score, "score": score}, batch_size=[len(scored)]))
        return {state: [ray.put(stage_result())] for state in states}


ROW = row_bytes(Row("1+1=", "2", "addition"))  # every prompt's train row, as the dock carries it


class PromptFeedDouble(FeedDouble):
    """The feed with every column the driver puts (prompt, mask, train row, the group's draw number)."""

    groups_drawn = 0

    def draw(self, num_prompts=None) -> DriverBatch:
        rows = 2 * GROUP_SIZE if num_prompts is None else num_prompts * GROUP_SIZE
        self.log.append(("draw", next(self.draws)))
        columns = {"prompt_ids": torch.ones(rows, 3, dtype=torch.int64), "prompt_mask": torch.ones(rows, 3)}
        first, self.groups_drawn = self.groups_drawn, self.groups_drawn + rows // GROUP_SIZE
        draws = torch.arange(first, self.groups_drawn).repeat_interleave(GROUP_SIZE)
        return DriverBatch(
            TensorDict(
                {
                    **columns,
                    "prompt_index": torch.zeros(rows, dtype=torch.int64),
                    "prompt_row": torch.frombuffer(bytearray(ROW * rows), dtype=torch.uint8).view(rows, len(ROW)),
                    "prompt_draw": draws,
                },
                batch_size=[rows],
            ),
            prompt_lengths=[3] * (rows // GROUP_SIZE),
        )


def test_dapo_rounds_read_every_rounds_facts_dropped_groups_included(tmp_path):
    """DAPO's reward_mean and response_length_mean keep their meaning: the driver reads the score and
    length of every round's samples through sample_facts (the filter's own read), the group the
    filter dropped included, and reads nothing again after the rounds."""
    from rldock.config.algorithm import AlgorithmSpec
    from rldock.config.dock import DockSpec
    from rldock.runtime.dock import TransferDock
    from rldock.runtime.driver.prompt_ledger import PromptLedger
    from rldock.runtime.driver.schedule.rounds import fill_by_rounds

    recipe = get_recipe("dapo")
    bank = TransferDock.create(
        DockSpec(timeout_s=5.0), states=dict(recipe.consumes), num_samples=2 * GROUP_SIZE, group_size=GROUP_SIZE
    )
    # round 0: group 0 scores alike (dropped), group 1 differs (kept); round 1 refills group 0, which differs
    workers = RoundWorkersDouble(bank, [[[1.0, 1.0], [0.0, 1.0]], [[0.5, 0.0]]])
    log: list = []
    books = BooksDouble(log)
    driver = Driver(recipe, tmp_path, GROUP_SIZE, workers, PromptFeedDouble(log), books, books)
    algo = AlgorithmSpec(
        name="dapo",
        num_prompts_per_iteration=2,
        num_responses_per_prompt=GROUP_SIZE,
        max_prompt_length=3,
        max_response_length=4,
        learning_rate=0.0,
    )
    try:
        _, _, sampled = fill_by_rounds(driver, bank, 1, rounds=recipe.sampling_rounds, algo=algo)
        assert sampled.metrics["dynamic_sampling/rounds"] == 2
        assert sampled.facts.scores == [1.0, 1.0, 0.0, 1.0, 0.5, 0.0]  # both rounds' samples, in read order
        assert sampled.facts.response_lengths == [1, 2, 3, 1, 1, 2]  # rows 0-3, then row 0-1 again
        # the prompt ledger's view: groups 0 and 1 drawn first, group 2 refilling slot 0; the filter's group
        # is passed over, the kept ones train
        assert sampled.facts.draws == {0, 1, 2}
        kept = sampled.batch.batch["prompt_draw"].tolist()
        assert kept == [2, 2, 1, 1]
        ledger = PromptLedger()
        assert ledger.settle(1, read=sampled.facts.draws, put=kept, drawn=3) == {
            "prompts/trained_groups": 2,
            "prompts/passed_over_groups": 1,
            "prompts/open_groups": 0,
            "prompts/trained_twice": 0,
        }
        assert bank.get("sample_facts", ["score"], batch_size=2 * GROUP_SIZE, whole_groups=True) is None  # all read
    finally:
        bank.shutdown()


def test_the_driver_numbers_each_rows_episode_where_an_episode_is_several_rows(tmp_path):
    """Groups of 2 episodes x 3 rows (a harness's segments): the put of group slots 1 and 3 writes each row's
    episode by its dock row, the same numbers whichever round puts the group."""
    from dataclasses import replace

    log: list = []
    books = BooksDouble(log)
    put: dict = {}

    class EpisodeBank(BankDouble):
        def put_groups(self, groups, shared, samples=None) -> None:
            put["episode"] = samples["episode"].tolist()

    driver = Driver(
        recipe=replace(RECIPE, driver_produces=(*RECIPE.driver_produces, "episode")),
        output_dir=tmp_path,
        group_size=6,
        workers=WorkersDouble(log),
        feed=FeedDouble(log),
        books=books,
        counters=books,
        rows_per_episode=3,
    )
    fed = DriverBatch(TensorDict({"prompt_ids": torch.zeros(12, 3)}, batch_size=[12]), prompt_lengths=[3, 3])
    driver.put_groups(torch.tensor([1, 3]), fed, EpisodeBank("bank", log))
    assert put["episode"] == [2, 2, 2, 3, 3, 3, 6, 6, 6, 7, 7, 7]


class CallsWorkersDouble(WorkersDouble):
    """The workers, logging how many prompt groups each launch hands ahead (None: none)."""

    def launch(self, call: StageCall, specs) -> dict[str, list]:
        self.log.append(("ahead", call.iteration, None if call.ahead is None else len(call.ahead)))
        return super().launch(call, specs)


@pytest.mark.parametrize(("first", "handed"), [(1, 2 * 2), (2, 2), (3, None)])
def test_carried_episodes_prompts_are_handed_ahead_with_the_attempts_first_iteration_only(tmp_path, first, handed):
    """A run of 3 iterations at max_staleness 2 with G = 2 (a resumed attempt starting at `first`): the
    first iteration hands the groups of the next batches the run reaches, one row per group, drawn besides
    its own; the later ones hand none. A worker's death keeps no bank (the open episodes died with it)."""
    log: list = []
    driver = recording_driver(tmp_path, log)
    driver = Driver(**{**driver.__dict__, "workers": CallsWorkersDouble(log), "feed": PromptFeedDouble(log)})
    ahead = PromptsAhead(iterations=3, max_staleness=2, num_prompts=2, group_size=GROUP_SIZE)
    schedule = SyncSchedule(driver, banks_of(log, 1), algo=ALGO, ahead=ahead)
    for iteration in range(first, 4):
        schedule.run(iteration)
    launches = [entry for entry in log if entry[0] == "ahead"]
    assert launches[0] == ("ahead", first, handed)  # the states before the update
    assert all(entry[2] is None for entry in launches[1:])
    assert sum(entry[0] == "draw" for entry in log) == (4 - first) + (handed is not None)
    stopped: list = []
    schedule.keep_inflight(lambda: stopped.append(True))
    assert stopped == []
