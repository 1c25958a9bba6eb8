"""The RL driver's loop: restarts, iterations, records and checkpoints.

The driver has three lifetimes (docs/architecture.md, "The driver"):
- the job's inputs (inputs.py), prepared once: the recipe, the data and its feed, the tokenizer,
  the initial policy (after the warm-up) and the evaluator;
- an attempt (attempt.py), a context manager owning the devices, the dock banks, the environment
  servers and the workers; a worker's death ends it, and its exit stops all of it;
- the trainer here, which starts attempts (a new one from the last checkpoint after a worker died,
  `max_restarts` times), runs the iterations of each through the schedule chosen for it
  (runtime/driver/schedule/: the order of an iteration's calls; the schedule gets the attempt's workers,
  the feed and the bookkeeping as objects), and keeps the records (metrics.iteration_record,
  metrics.jsonl, tracking), evaluation, progress lines and checkpoints.

One iteration, as data moves: driver puts G prompts (each repeated N times) -> rollout (actor
ranks, vLLM) -> old logprobs (actor ranks) | reference logprobs | rule reward -> advantages ->
update (actor ranks, DDP) -> new weights pushed into each rank's engine in memory. That is GRPO's
recipe; the algorithm's recipe (flow/catalogue.py) says which states run. All stages are
launched at once; the dock's controllers hand a sample to a stage only when its input columns are
ready, which is what orders them.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import ray

from rldock.config import JobConfig
from rldock.runtime import checkpoint as ckpt
from rldock.runtime.data.sampler import PromptSampler
from rldock.runtime.dock import DockActorDiedError, DockTimeoutError
from rldock.runtime.driver.attempt import Attempt
from rldock.runtime.driver.bookkeeping import Bookkeeper, DockCounters
from rldock.runtime.driver.evaluation import val_metrics
from rldock.runtime.driver.inputs import prepare_inputs
from rldock.runtime.driver.iteration_hold import IterationHold
from rldock.runtime.driver.mismatch_budget import MismatchBudget
from rldock.runtime.driver.preemption import StopRequest
from rldock.runtime.driver.prompt_ledger import PromptLedger
from rldock.runtime.driver.records import (
    MetricsLog,
    bar_figures,
    iteration_record,
    iteration_records,
    last_evaluation,
    progress_bar,
    progress_line,
)
from rldock.runtime.driver.schedule import WORKER_DEATHS, Driver, Schedule, choose_schedule
from rldock.runtime.driver.tracking import Tracking, open_tracking
from rldock.runtime.driver.utilisation import UtilisationInputs, measure_utilisation_inputs
from rldock.runtime.flow.columns import PROMPT_DRAW
from rldock.runtime.flow.states import ACTOR
from rldock.runtime.rollout.modes import counters_of
from rldock.runtime.workers import cluster

logger = logging.getLogger(__name__)


class OutputDirInUse(RuntimeError):
    pass


@dataclass(frozen=True)
class AttemptLoop:
    """What the iterations of one attempt run with: its workers, the schedule chosen for them, the
    bookkeeping's order (JobConfig.ablations.background_bookkeeping; bookkeeping.py), the dock
    counters and the tracking logs."""

    attempt: Attempt
    schedule: Schedule
    books: Bookkeeper
    counters: DockCounters
    tracking: Tracking


class Trainer:
    def __init__(
        self,
        cfg: JobConfig,
        output_dir: str | Path,
        *,
        resume: bool = False,
        show_progress: bool = True,
        max_restarts: int = 0,
    ):
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.show_progress = show_progress
        self.max_restarts = max_restarts
        self.metrics = MetricsLog(self.output_dir)
        self._check_output_dir(resume)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        self.resume_from = ckpt.latest_checkpoint(self.output_dir) if resume else None
        # Ray's processes start beside the inputs (inputs.py), unless the run has nothing left to do
        done = self.resume_from is not None and self.resume_from.iteration >= cfg.iterations
        self.inputs = prepare_inputs(cfg, self.output_dir, beside=None if done else lambda: cluster.connect(cfg))
        self._last_evaluation: dict | None = None  # the newest record holding val/ metrics
        self._hold = IterationHold.from_environ()  # test tooling: a no-op unless RLDOCK_TEST_HOLD_FILE is set
        self._utilisation: UtilisationInputs | None = None  # the mfu/ metrics' inputs, found once per run
        self._stop = StopRequest()  # the iteration under way saved for SIGTERM (then Preempted) or a drained worker
        self.ledger = PromptLedger()  # what became of each prompt group drawn (prompt_ledger.py)

    def _check_output_dir(self, resume: bool) -> None:
        if not resume and (self.metrics.path.exists() or ckpt.latest_checkpoint(self.output_dir)):
            raise OutputDirInUse(
                f"{self.output_dir} already holds a run; pass --resume to continue it or choose another --output"
            )

    # --- attempts -----------------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Run the job; returns the metrics records of its iterations (metrics.jsonl also holds
        iteration 0, the initial policy's evaluation, when evaluation.at_start is on)."""
        if self.resume_from is not None and self.resume_from.iteration >= self.cfg.iterations:
            logger.info("%s already finished all %d iterations", self.output_dir, self.cfg.iterations)
            records = self.metrics.read()
            self._last_evaluation = last_evaluation(records)
            if records and not self.show_progress:
                # A retry can start after the previous attempt finished (the worker was lost as
                # the last iteration ended): say where the run is, or the operator would keep the
                # previous attempt's last line, an iteration short.
                self._report_progress(records[-1])
            return iteration_records(records)
        cluster.connect(self.cfg)
        self._stop.install(self.output_dir)  # after ray.init, which installs a SIGTERM handler of its own
        for number in range(self.max_restarts + 1):
            last = number == self.max_restarts
            try:
                start_iteration = self._resume_position()
                with self._attempt() as attempt:
                    if self._utilisation is None:
                        actor = attempt.started().actors[0]
                        self._utilisation = measure_utilisation_inputs(self.cfg, self.inputs.reference_dir, actor)
                    self._loop(attempt, start_iteration, keep_inflight=not last)
                break
            except WORKER_DEATHS as error:
                # A worker process or dock actor died (killed, out of memory, node lost): restart
                # every worker and the dock from the last checkpoint. Errors raised by our own code
                # are not retried: they would fail the same way again.
                if last:
                    raise
                logger.warning(
                    "a worker died (%s); restart %d of %d from the last checkpoint",
                    error,
                    number + 1,
                    self.max_restarts,
                )
                self.resume_from = ckpt.latest_checkpoint(self.output_dir)
        return iteration_records(self.metrics.draw())

    def _attempt(self) -> Attempt:
        return Attempt(self.cfg, self.inputs, output_dir=self.output_dir, resume_from=self.resume_from)

    def _resume_position(self) -> int:
        """The first iteration to run: after the checkpoint resumed from (whose sampler position and prompt
        ledger the feed and the run take), else 1. Records after that checkpoint belong to iterations that
        will be redone; the groups its ledger holds open (or every group drawn, without one) are drawn again."""
        start_iteration, feed = 1, self.inputs.feed
        self.ledger = PromptLedger()
        if self.resume_from is not None:
            start_iteration = self.resume_from.iteration + 1
            feed.load_state_dict(self.resume_from.state()["sampler"])
            self.ledger = PromptLedger.load(self.resume_from.path, drawn=feed.drawn)
            logger.info("resuming after iteration %d from %s", self.resume_from.iteration, self.resume_from.path)
        feed.requeue(self.ledger.open_below(feed.drawn))
        if feed.requeued:
            logger.info("drawing again the %d prompt groups drawn and not trained before", len(feed.requeued))
        self._last_evaluation = last_evaluation(self.metrics.truncate_after(start_iteration - 1))
        return start_iteration

    # --- iterations ---------------------------------------------------------------------------

    def _loop(self, attempt: Attempt, start_iteration: int, *, keep_inflight: bool) -> None:
        """Run the iterations from `start_iteration` on `attempt`'s workers. After a worker died,
        with `keep_inflight`, the schedule keeps what the retry can resume from."""
        cfg, recipe = self.cfg, self.inputs.recipe
        workers, banks = attempt.started(), attempt.banks
        assert banks is not None  # created with the workers
        books = Bookkeeper(background=cfg.ablations.background_bookkeeping)
        counters = DockCounters(books, banks.docks)
        driver = Driver(
            recipe=recipe,
            output_dir=self.output_dir,
            group_size=cfg.rows_per_group,
            rows_per_episode=cfg.rows_per_episode,
            workers=workers,
            feed=self.inputs.feed,
            books=books,
            counters=counters,
        )
        # The states the actor ranks run over the responses, all but the rollout and the updates
        # (under LoRA the reference pass too: its spec's group is the actor's, job_recipe).
        actor_rank_states = {s.name for s in recipe.specs if s.group == ACTOR and s.runs_on == "ranks" and not s.trains}
        schedule = choose_schedule(cfg, driver, banks, actor_rank_states=actor_rank_states)
        try:
            self._iterate(attempt, schedule, books, counters, start_iteration)
        except WORKER_DEATHS:
            if keep_inflight:  # what the retry can resume from, as the schedule keeps it
                schedule.keep_inflight(stop_workers=attempt.kill_workers)
            raise

    def _iterate(
        self, attempt: Attempt, schedule: Schedule, books: Bookkeeper, counters: DockCounters, start_iteration: int
    ) -> None:
        total, evaluator = self.cfg.iterations, self.inputs.evaluator
        startup = attempt.startup()  # timing/startup, before anything here opens; None after the first attempt
        # The initial policy's evaluation is logged as iteration 0, once per run.
        evaluate_at_start = (
            evaluator is not None
            and self.cfg.evaluation.at_start
            and start_iteration == 1
            and not any(r["iteration"] == 0 for r in self.metrics.read())
        )
        tracking = open_tracking(self.cfg, self.output_dir, first_step=0 if evaluate_at_start else start_iteration)
        loop = AttemptLoop(attempt, schedule, books, counters, tracking)
        progress = progress_bar(
            total, start_iteration - 1, enabled=self.show_progress, desc=self.cfg.algorithm.name.upper()
        )
        save = functools.partial(self._save_checkpoint, loop)  # a stop's or a drained worker's checkpoint
        failed, budget = True, MismatchBudget(self.cfg.monitoring, self.metrics.read(), loop.attempt.started().actors)
        try:
            if evaluate_at_start:
                self._log(loop, {"iteration": 0, **self._evaluate(loop, 0)})
            for iteration in range(start_iteration, total + 1):
                # SIGTERM, or a worker pod being deleted: the iteration just done saved; SIGTERM then stops
                self._stop.between_iterations(iteration - 1, first=start_iteration, save=save)
                self._hold.wait_before(iteration)
                record = self._run_iteration(loop, iteration)
                if startup is not None:  # the first record this run writes
                    record["timing"]["startup"], startup = startup, None
                if self._evaluation_due(iteration):  # after the update: the engines hold its weights
                    record.update(self._evaluate(loop, iteration))
                over = budget.judge(record)  # monitoring.mismatch: `stop` checkpoints
                self._log(loop, record)
                if iteration % self.cfg.checkpoint.interval == 0 or iteration == total or (over and over.stops):
                    self._save_checkpoint(loop, iteration)
                progress.set_postfix(bar_figures(record, self._last_evaluation), refresh=False)
                progress.update(1)
                if not self.show_progress:  # the bar is for people, the lines for the operator
                    self._report_progress(record)
                if over is not None:
                    budget.act(over)  # `warn` logs, `correct` switches the correction on, `stop` raises
            failed = False
        finally:
            progress.close()
            try:
                # Every finished iteration's record reaches the files, also on failure; then the
                # loop's own error is the one raised (a bookkeeping error is only logged).
                books.close(raise_errors=not failed)
            finally:
                tracking.close()

    def _run_iteration(self, loop: AttemptLoop, iteration: int) -> dict:
        cfg, algo, dataset = self.cfg, self.cfg.algorithm, self.inputs.dataset
        stages = loop.schedule.run(iteration)
        record = iteration_record(
            stages.results,
            iteration=iteration,
            update_state=self.inputs.recipe.update_state,
            prompt_lengths=stages.fed.prompt_lengths,
            rewards=stages.facts.scores,
            response_lengths=stages.facts.response_lengths,
            put_seconds=stages.put_seconds,
            seconds=stages.ended - stages.started,
            cycle=stages.cycle,
            num_prompts=algo.num_prompts_per_iteration,
            num_responses=algo.num_responses_per_prompt,
            num_devices=self.inputs.layout.num_actor_ranks,
            rollout_counters=counters_of(cfg),
            round_metrics=stages.round_metrics,
            # the prompt set's size and the over-long prompts it dropped, in the first record only
            data_metrics={"data/num_prompts": len(dataset), "data/dropped_prompts": dataset.num_dropped}
            if iteration == 1
            else {},
            utilisation=self._utilisation,
        )
        held = self.cfg.rollout.partial_rollout == "carry"  # ranks hold groups across iterations
        fed = None if held else stages.fed.batch[PROMPT_DRAW[0]].tolist()
        record.update(self.ledger.settle(iteration, read=stages.facts.draws, put=fed, drawn=self.inputs.feed.drawn))
        # a Future until _write_record: read while the driver starts the next iteration (the
        # driver's next put waits for it, so the counters hold exactly this iteration's traffic)
        record["dock"] = loop.counters.read(stages.bank)
        phases = loop.attempt.started().timeline(iteration)
        if phases is not None:  # serial phase schedule: each shared device's phases, start and end (s)
            record["phases"] = phases
        return record

    def _log(self, loop: AttemptLoop, record: dict) -> None:
        loop.books.later(self._write_record, loop.tracking, record)
        if val_metrics(record):
            self._last_evaluation = record

    def _write_record(self, tracking: Tracking, record: dict) -> None:
        """Append `record` to metrics.jsonl and the `tracking` logs, its dock traffic read by then (its
        "dock" is the Future of the counters' read until here)."""
        if "dock" in record:  # iteration 0 (the initial policy's evaluation) moved no sample
            try:
                record["dock"] = record["dock"].result()
            except (DockActorDiedError, DockTimeoutError, ray.exceptions.RayError) as error:
                # The record is written without its traffic; the error itself is raised where the
                # driver waits for the counters (its next put), which fails the attempt.
                logger.warning("iteration %d's dock counters could not be read (%s)", record["iteration"], error)
                del record["dock"]
        self.metrics.append(record)
        tracking.append(record)

    def _evaluation_due(self, iteration: int) -> bool:
        interval = self.cfg.evaluation.interval
        return interval > 0 and (iteration % interval == 0 or iteration == self.cfg.iterations)

    def _evaluate(self, loop: AttemptLoop, iteration: int) -> dict[str, float]:
        evaluator = self.inputs.evaluator
        assert evaluator is not None  # called only with evaluation.interval > 0, which makes one
        return evaluator.run(loop.attempt.started().engine_actors, iteration=iteration)

    def _report_progress(self, record: dict) -> None:
        """One machine-readable line per iteration on stdout; the operator reads it from the Ray
        job log (it runs jobs with --no-progress)."""
        latest = ckpt.latest_checkpoint(self.output_dir)
        estimate = self.inputs.checkpoint_estimate_s if latest is None else None  # a retry may not prepare inputs
        print(progress_line(record, self.cfg.iterations, latest, self._last_evaluation, estimate), flush=True)

    def _save_checkpoint(self, loop: AttemptLoop, iteration: int) -> None:
        # The records up to this iteration are in metrics.jsonl before the checkpoint commits: a
        # resume keeps only the records up to its checkpoint, and redoes none of these.
        loop.books.wait()
        staging = ckpt.staging_dir(self.output_dir, iteration)
        loop.attempt.save(staging)  # each worker group's part, the recipe's groups iterated (flow/states.py)
        # The driver draws no random numbers itself: the sampler's state is the data position, the
        # ranks' torch RNG covers training, and sampling seeds derive from (seed, iteration, index).
        # A run-ahead schedule drew the next iteration's prompts already: it keeps the position before that draw.
        state = {"sampler": loop.schedule.checkpoint_sampler_state()}
        self.ledger.save(staging, drawn=PromptSampler.drawn_in(state["sampler"]))
        ckpt.commit(self.output_dir, staging, iteration, state, keep_last=self.cfg.checkpoint.keep_last)
        loop.books.later(self.metrics.draw)  # the records up to this iteration
