"""The synchronous schedule keeps the dock of an iteration a worker died in, and its retry resumes
from it; the trainer restarts an attempt whose worker or dock died.

A GRPO dock on local Ray with synthetic columns; the schedule's driver and the Trainer are built
without models or workers (only what these steps use), so this runs in seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import ray
import torch
from tensordict import TensorDict

from rldock.config.job import DockSpec
from rldock.runtime import checkpoint as ckpt
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.driver.preemption import StopRequest
from rldock.runtime.driver.schedule import Driver, Inflight, SyncSchedule
from rldock.runtime.driver.schedule.inflight import resume_inflight
from rldock.runtime.driver.trainer import Trainer
from rldock.runtime.flow.catalogue import get_recipe

NUM_SAMPLES, GROUP_SIZE = 8, 2
RECIPE = get_recipe("grpo")


@pytest.fixture(scope="module", autouse=True)
def ray_session(start_local_ray) -> Iterator[None]:
    with start_local_ray(num_cpus=2):
        yield


def columns(names: tuple[str, ...], indices: list[int]) -> TensorDict:
    """Each sample's columns: its index 3 times, but its prompt group's draw number (the group's slot)."""
    index = torch.tensor(indices, dtype=torch.float32)
    out = TensorDict({name: index[:, None].expand(-1, 3).clone() for name in names}, batch_size=[len(indices)])
    if "prompt_draw" in names:
        out["prompt_draw"] = torch.tensor(indices, dtype=torch.int64) // GROUP_SIZE
    return out


class DriverDouble:
    """The driver fields keep_inflight reads and its read of the samples' facts (the real one's); a
    schedule that launched anything would fail on it."""

    def __init__(self, output_dir) -> None:
        self.recipe, self.output_dir = RECIPE, output_dir
        self.workers = SimpleNamespace(recover=lambda ref, error: None)  # no worker of theirs is replaced

    read_facts = Driver.read_facts


def schedule_double(tmp_path) -> tuple[SyncSchedule, TransferDock]:
    """A synchronous schedule over one real bank, with a driver that only says where to keep it."""
    dock = TransferDock.create(
        DockSpec(timeout_s=0.5), states=dict(RECIPE.consumes), num_samples=NUM_SAMPLES, group_size=GROUP_SIZE
    )
    return SyncSchedule(DriverDouble(tmp_path), DockBanks([dock]), algo=None), dock


def test_the_retry_keeps_finished_work_and_runs_only_what_is_left(tmp_path) -> None:
    schedule, dock = schedule_double(tmp_path)
    everything = list(range(NUM_SAMPLES))
    # Iteration 3 so far: the driver's prompts, the whole rollout (two ranks, both returned), half
    # of the reference (its other half was taken by a rank that died), the update took 4 samples.
    dock.put(torch.arange(NUM_SAMPLES), columns(RECIPE.produces["driver"], everything))
    for rank in (0, 1):
        indices, _ = dock.get("rollout", ["prompt_ids"], rank=rank, batch_size=4, whole_groups=True)
        dock.put(indices, columns(RECIPE.produces["rollout"], indices.tolist()))
    done, _ = dock.get("reference", ["prompt_ids"], batch_size=4)
    dock.put(done, columns(("ref_logprobs",), done.tolist()))
    lost, _ = dock.get("reference", ["prompt_ids"], rank=1, batch_size=4)
    rollout_results = [StageResult(metrics={"decode_steps": 2}), StageResult(metrics={"decode_steps": 1})]
    schedule.inflight = Inflight(
        3,
        finished={"rollout": rollout_results, "reference": [StageResult(dispatch_s=0.1)]},
        launched={state: 2 for state in ("rollout", "reference", "actor_inference")},
    )
    stopped = []
    schedule.keep_inflight(stop_workers=lambda: stopped.append(True))
    assert stopped == [True]  # the workers stop before the dock is read
    dock.shutdown()

    _, again_dock = schedule_double(tmp_path)
    inflight = Inflight(3)
    snapshot = ckpt.load_inflight(tmp_path, 3)
    assert again_dock.can_load(snapshot["dock"])
    _, sampled = resume_inflight(again_dock, None, snapshot, inflight, recipe=RECIPE)
    assert inflight.skip == {"rollout"}  # the reference had one of its two ranks back
    assert sampled.results["rollout"] == rollout_results  # reused in this iteration's metrics
    assert inflight.launched == {"rollout": 2}
    # Rollout has nothing left; the reference gets back only what the dead rank had taken.
    assert again_dock.get("rollout", ["prompt_ids"], batch_size=NUM_SAMPLES, whole_groups=True) is None
    again, _ = again_dock.get("reference", ["prompt_ids"], batch_size=NUM_SAMPLES)
    assert again.tolist() == lost.tolist()
    indices, batch = again_dock.get("actor_inference", ["response_ids"], batch_size=NUM_SAMPLES)
    assert indices.tolist() == everything and torch.equal(batch["response_ids"][:, 0], indices.float())
    again_dock.shutdown()


def test_no_snapshot_when_the_dock_died_too(tmp_path, kill_actor) -> None:
    schedule, dock = schedule_double(tmp_path)
    kill_actor(dock._route.peers()[0].handle)
    schedule.inflight = Inflight(2)
    schedule.keep_inflight(stop_workers=lambda: None)  # logs a warning: the iteration is redone from its start
    assert ckpt.load_inflight(tmp_path, 2) is None
    dock.shutdown()


def test_a_retry_of_a_finished_run_reports_its_last_iteration(tmp_path, capsys) -> None:
    """A retry that finds every iteration done (its predecessor finished as a worker was lost)
    prints the last iteration's progress line, so the operator does not keep the line before it."""
    from types import SimpleNamespace

    from rldock.contract.progress import last_progress
    from rldock.runtime.driver.records import MetricsLog

    staging = ckpt.staging_dir(tmp_path, 2)
    ckpt.commit(tmp_path, staging, 2, {}, keep_last=1)
    log = MetricsLog(tmp_path)
    for iteration in (1, 2):
        log.append(
            {
                "iteration": iteration,
                "reward_mean": 0.5,
                "kl": 0.0,
                "loss": 0.1,
                "response_length_mean": 3.0,
                "tokens_per_s_per_device": 1.0,
            }
        )
    trainer = Trainer.__new__(Trainer)
    trainer.cfg = SimpleNamespace(iterations=2)
    trainer.output_dir, trainer.metrics, trainer.show_progress = tmp_path, log, False
    trainer.resume_from = ckpt.latest_checkpoint(tmp_path)
    assert [r["iteration"] for r in trainer.run()] == [1, 2]
    record = last_progress(capsys.readouterr().out.splitlines())
    assert record is not None and (record["iteration"], record["iterations"], record["checkpoint"]) == (2, 2, 2)


@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_dock_actor_dying_under_the_driver_restarts_within_the_budget(
    tmp_path, kill_actor, max_restarts, monkeypatch
) -> None:
    """A lost node takes its warehouse with its workers, and the driver's own dock call (the reset
    before an iteration's prompts) may be the first to see it: run() restarts the attempt as for a
    dead worker while --max-restarts lasts, and raises once it is spent."""
    from types import SimpleNamespace

    from rldock.runtime.data.sampler import PromptSampler
    from rldock.runtime.dock import DockActorDiedError
    from rldock.runtime.driver.feed import Feed
    from rldock.runtime.driver.records import MetricsLog

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = SimpleNamespace(iterations=2)
    trainer.output_dir, trainer.metrics, trainer.show_progress = tmp_path, MetricsLog(tmp_path), False
    trainer.max_restarts, trainer.resume_from = max_restarts, None
    trainer._stop = StopRequest()  # not installed: this process keeps its own SIGTERM handling
    monkeypatch.setattr(trainer._stop, "install", lambda *args: None)
    trainer._utilisation = object()  # the mfu/ inputs, as if measured on an earlier attempt: no actor here
    trainer.inputs = SimpleNamespace(feed=Feed(None, PromptSampler(8, seed=0), None, None, "prompt_groups"))
    docks: list[TransferDock] = []
    kept: list[bool] = []

    @contextlib.contextmanager
    def attempt():  # an attempt's dock, less its workers
        docks.append(
            TransferDock.create(
                DockSpec(timeout_s=0.5), states=dict(RECIPE.consumes), num_samples=NUM_SAMPLES, group_size=GROUP_SIZE
            )
        )
        yield docks[-1]

    def loop(dock: TransferDock, start_iteration: int, *, keep_inflight: bool) -> None:
        kept.append(keep_inflight)
        if len(docks) == 1:  # the first attempt's node is lost before its next iteration
            kill_actor(docks[0]._route.peers()[0].handle)
            docks[0].reset()

    trainer._attempt, trainer._loop = attempt, loop
    try:
        if max_restarts == 0:
            with pytest.raises(DockActorDiedError):
                trainer.run()
            assert len(docks) == 1 and kept == [False]  # the last attempt keeps nothing for a retry
        else:
            assert trainer.run() == []
            assert len(docks) == 2 and kept == [True, False]
    finally:
        for dock in docks:
            dock.shutdown()


@ray.remote(num_cpus=0)
class _Rank:
    def work(self, value: int) -> dict:
        return {"value": value}


def test_a_death_keeps_what_the_other_ranks_had_returned(kill_actor) -> None:
    """gather_failing_fast, reading a dead rank's future first, still records the result another rank
    had returned: the in-flight retry reuses it (that rank's samples are done and would give none)."""
    from rldock.runtime.driver.schedule.stages import gather_failing_fast

    alive, doomed = _Rank.remote(), _Rank.remote()
    kill_actor(doomed)
    returned = alive.work.remote(1)
    dead = doomed.work.remote(2)
    ray.wait([returned, dead], num_returns=2)  # both done (one returned, one failed) before gather reads
    finished: dict[str, list[dict]] = {}
    with pytest.raises(ray.exceptions.RayActorError):
        gather_failing_fast({"reference": [dead], "rollout": [returned]}, finished)  # the dead one read first
    assert finished == {"rollout": [{"value": 1}]}


def test_a_resumed_iteration_reads_its_facts_from_the_dock(tmp_path) -> None:
    """The rollout and reward ranks wrote every sample's response length and score and died before
    returning: the retry's ranks find every sample done and return nothing of them, and the
    iteration's record still has every sample's facts, read from the dock (sample_facts) as a fresh
    iteration's are: no list is rebuilt from the ranks' results."""
    from rldock.runtime.driver.feed import DriverBatch
    from rldock.runtime.driver.schedule.steps import gather_stages

    schedule, dock = schedule_double(tmp_path)
    dock.put(torch.arange(NUM_SAMPLES), columns(RECIPE.produces["driver"], list(range(NUM_SAMPLES))))
    lengths, scores = {}, {}
    for rank in (0, 1):
        indices, _ = dock.get("rollout", ["prompt_ids"], rank=rank, batch_size=4, whole_groups=True)
        written = columns(RECIPE.produces["rollout"], indices.tolist())
        written["response_length"] = indices % 5 + 1  # (4,) 1..5
        lengths.update({int(i): int(n) for i, n in zip(indices, written["response_length"])})
        dock.put(indices, written)
    scored, _ = dock.get("reward", ["response_ids"], batch_size=NUM_SAMPLES)
    reward = columns(RECIPE.produces["reward"], scored.tolist())
    reward["score"] = scored.float() / 4  # (B,)
    scores.update({int(i): float(s) for i, s in zip(scored, reward["score"])})
    dock.put(scored, reward)
    schedule.inflight = Inflight(4, launched={"rollout": 2, "reward": 1})  # no rank returned
    schedule.keep_inflight(stop_workers=lambda: None)
    dock.shutdown()

    _, again_dock = schedule_double(tmp_path)
    inflight = Inflight(4)
    fed = DriverBatch(TensorDict({}, batch_size=[NUM_SAMPLES]), prompt_lengths=[3] * (NUM_SAMPLES // GROUP_SIZE))
    _, sampled = resume_inflight(again_dock, fed, ckpt.load_inflight(tmp_path, 4), inflight, recipe=RECIPE)
    assert inflight.resumed and "rollout" not in inflight.skip  # run again: no rank had returned
    rerun = [_Rank.remote().work.remote(0) for _ in range(2)]  # results without any per-sample fact
    stages = gather_stages(
        DriverDouble(tmp_path),
        {"rollout": rerun},
        inflight,
        fed=fed,
        put_seconds=0.0,
        sampled=sampled,
        bank=again_dock,
        started=0.0,
    )
    assert stages.facts.response_lengths == [lengths[i] for i in range(NUM_SAMPLES)]
    assert stages.facts.scores == [scores[i] for i in range(NUM_SAMPLES)]
    assert stages.facts.draws == set(range(NUM_SAMPLES // GROUP_SIZE))  # every group, for the prompt ledger
    again_dock.shutdown()


class FactsBankDouble:
    """A bank whose facts come in one read that the dock marks the last for its reader (Grant.drained)."""

    def __init__(self) -> None:
        self.reads, self.drained = 0, False

    def get(self, state: str, columns, *, batch_size: int):
        self.reads += 1
        if self.drained:
            return None
        self.drained = True
        rows = {"prompt_draw": torch.tensor([0, 0]), "response_length": torch.tensor([3, 5]), "score": torch.ones(2)}
        return torch.arange(2), TensorDict(rows, batch_size=[2])


def test_the_facts_are_read_in_one_round_trip_when_the_dock_says_those_rows_were_the_last(tmp_path) -> None:
    bank = FactsBankDouble()
    facts = DriverDouble(tmp_path).read_facts(bank, num_samples=2)
    assert bank.reads == 1 and facts.response_lengths == [3, 5]
