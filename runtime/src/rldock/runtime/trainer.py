"""The RL driver: prepares the initial policy, starts the worker groups, and runs iterations
whose every sample moves through the transfer dock, with checkpoints, metrics and progress.

One iteration, as data moves (see docs/architecture.md):
  driver puts G prompts (each repeated N times) -> rollout (actor ranks, vLLM) -> old logprobs
  (actor ranks) | reference logprobs | rule reward -> advantages -> update (actor ranks, DDP)
  -> new weights pushed into each rank's engine in memory. That is GRPO's recipe; the algorithm's
recipe (runtime/src/rldock/runtime/algorithms/recipes.py) says which states run, e.g. PPO adds the critic's value
inference (before advantages) and its update, and a `model` reward term the reward model's scoring
(before the reward).
All stages are launched at once; the dock's controllers hand a sample to a stage only when its
input columns are ready, which is what orders them.

With `training.mode: async` (and dock.max_staleness >= 1) the driver runs one iteration ahead: before
iteration i's update it puts iteration i+1's prompts into the other dock bank (dock/banks.py) and
launches every stage of i+1 but its update, so on the actor ranks i+1's generation and old-logprob
pass run before i's update, and the other workers' stages of i+1 overlap that update. Iteration
i+1's samples then come from the policy before update i: one version old (`staleness_mean`). With
partial rollout (rollout.partial_rollout) that generation is cut at rollout.max_tokens_per_round and
completed after update i, before i+1's old-logprob pass (workers/partial_rollout.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import ray
import torch

from rldock.config import JobConfig
from rldock.contract.progress import evaluation_headline, format_progress
from rldock.runtime import checkpoint as ckpt
from rldock.runtime import cluster
from rldock.runtime.algorithms.recipes import job_recipe
from rldock.runtime.bookkeeping import Bookkeeper
from rldock.runtime.data import (DataFiles, PromptDataset, PromptSampler, Row, columns_of, load_rows,
                                 prepare_data_files, tokenizer_corpus)
from rldock.runtime.dataflow import REWARD_MODEL_STATE, TOKEN_COLUMNS
from rldock.runtime.dock import DockActorDiedError, DockTimeoutError, TransferDock
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.grouping import split_group_columns
from rldock.runtime.engines.replica_devices import engine_environments
from rldock.runtime.evaluation import EvalExample, Evaluator, val_metrics
from rldock.runtime.metrics import (PLOT_FILE, MetricsLog, dock_traffic, headline_key, plot_progress,
                                   tokens_per_s_per_device)
from rldock.runtime.models.loading import load_tokenizer
from rldock.runtime.models.tiny import build_tiny_model
from rldock.runtime.rewards import RewardScorer, merge_reward_metrics
from rldock.runtime.sampling import BATCH_BUILDERS, DriverBatch, DynamicSampling, SampledRounds, group_rows
from rldock.runtime.tracking import TensorBoardLog
from rldock.runtime.turns import hand_out_turns
from rldock.runtime.warmup import run_warmup
from rldock.runtime.workers.actor import ADAPTER_DIR, ActorWorker
from rldock.runtime.workers.partial_rollout import RESUME_STATE, partial_metrics
from rldock.runtime.workers.advantage import AdvantageWorker
from rldock.runtime.workers.critic import CriticWorker
from rldock.runtime.workers.reference import ReferenceWorker
from rldock.runtime.workers.reward import RewardWorker
from rldock.runtime.workers.reward_model import RewardModelWorker

logger = logging.getLogger(__name__)

WARMUP_DIR = "warmup"


class OutputDirInUse(RuntimeError):
    pass


def prepare_base_model(cfg: JobConfig, rows: list[Row]) -> Path:
    """The base model's directory, after building the tiny model there (with a tokenizer trained on
    the train rows) when `model.builder` asks for it and none exists yet."""
    base = Path(cfg.model.path).expanduser()
    if cfg.model.builder and not (base / "config.json").is_file():
        logger.info("building tiny model %s at %s", cfg.model.builder, base)
        texts = tokenizer_corpus(rows, cfg.data.system_prompt)
        _write_atomically(base, lambda tmp: build_tiny_model(tmp, texts=texts, seed=cfg.seed))
    return base


def prepare_initial_policy(cfg: JobConfig, output_dir: Path, base: Path, dataset: PromptDataset) -> Path:
    """Model dir the RL phase starts from (and the reference policy): the base model, after the
    supervised warm-up when one is configured (skipped when its output exists)."""
    if cfg.warmup.steps == 0:
        return base
    warm = output_dir / WARMUP_DIR
    if not (warm / "config.json").is_file():
        logger.info("supervised warm-up: %d steps", cfg.warmup.steps)
        _write_atomically(warm, lambda tmp: run_warmup(base, tmp, dataset=dataset, spec=cfg.warmup, seed=cfg.seed))
    return warm


def load_prompt_set(cfg: JobConfig, output_dir: Path) -> tuple[DataFiles, list[Row]]:
    """The job's data files (generated first if configured) and their train rows."""
    files = prepare_data_files(cfg.data, output_dir, seed=cfg.seed)
    return files, load_rows(files.train, columns_of(cfg.data))


def _write_atomically(final: Path, write) -> None:
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    write(tmp)
    if final.exists():  # another process finished the same build first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, final)


@dataclass
class WorkerGroups:
    """The Ray actors of a job. Only the groups the recipe's states need exist: DPO has no reward or
    advantage worker, GRPO and DAPO no advantage worker where the reward computes it
    (algorithm.fuse_reward_advantage), only PPO and PF-PPO have critic ranks (one per DP rank), only a job with a
    `model` reward term a reward model."""

    actors: list
    references: list
    reward: object | None = None
    advantage: object | None = None
    critics: list = field(default_factory=list)
    reward_model: object | None = None
    generation_tp: int = 1  # rollout.tensor_parallel_size: actor ranks per generation replica

    @property
    def engine_actors(self) -> list:
        """The actors holding a rollout engine: each generation replica's first rank."""
        return self.actors[::self.generation_tp]

    def all(self) -> list:
        singles = (self.reward, self.advantage, self.reward_model)
        return [*self.actors, *self.references, *self.critics,
                *(handle for handle in singles if handle is not None)]


class Trainer:
    def __init__(self, cfg: JobConfig, output_dir: str | Path, *, resume: bool = False,
                 show_progress: bool = True, max_restarts: int = 0):
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.show_progress = show_progress
        self.max_restarts = max_restarts
        self.metrics = MetricsLog(self.output_dir)
        self._check_output_dir(resume)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        self.recipe = job_recipe(cfg)  # less the passes this config makes redundant
        if "reward" in self.recipe.states:
            RewardScorer(cfg.reward)  # fail fast (RewardError naming the term) before any model work
        self.data_files, rows = load_prompt_set(cfg, self.output_dir)
        base = prepare_base_model(cfg, rows)
        self.tokenizer = load_tokenizer(base)  # the warm-up saves the same tokenizer again
        self.dataset = PromptDataset(rows, tokenizer=self.tokenizer, spec=cfg.data,
                                     max_prompt_length=cfg.algorithm.max_prompt_length)
        logger.info("prompt set: %d prompts from %s (%d dropped as longer than algorithm.max_prompt_length)",
                    len(self.dataset), self.data_files.train, self.dataset.num_dropped)
        shuffle_seed = cfg.seed if cfg.data.shuffle_seed is None else cfg.data.shuffle_seed
        self.sampler = PromptSampler(len(self.dataset), seed=shuffle_seed)
        self.reference_dir = prepare_initial_policy(cfg, self.output_dir, base, self.dataset)
        self.evaluator = heldout_evaluation(cfg, self.tokenizer, self.data_files.val)
        self._last_evaluation: dict | None = None  # the newest record holding val/ metrics
        self.resume_from = ckpt.latest_checkpoint(self.output_dir) if resume else None
        self.dock: TransferDock | None = None  # the bank of the iteration running now
        self.banks: DockBanks | None = None
        self.workers: WorkerGroups | None = None
        self._placement = None  # the Ray placement group holding the workers' devices
        self._turns = None  # the TurnKeeper of a serial phase schedule (runtime/turns.py)
        self._last_dock_stats: dict[int, dict] = {}  # per bank: its cumulative stats when last read
        # Counters and metrics files, in a background thread while the next iteration starts
        # (training.background_bookkeeping; runtime/bookkeeping.py); a fresh one per _loop.
        self._bookkeeping = Bookkeeper(background=False)
        self._counters = None  # the Future of the last counters read, awaited before the next put
        self._last_iteration_end: float | None = None  # perf_counter when the last iteration's stages ended
        # Async mode: the next iteration, put and launched (all but its update) ahead of this one's update.
        self.runs_ahead = cfg.training.mode == "async" and cfg.dock.max_staleness >= 1
        self._ahead: _Ahead | None = None
        # The iteration running now: stage results as ranks return, and ranks started per stage,
        # kept with the dock's state if a worker dies (see _keep_inflight).
        self._inflight: _Inflight | None = None

    def _check_output_dir(self, resume: bool) -> None:
        if not resume and (self.metrics.path.exists() or ckpt.latest_checkpoint(self.output_dir)):
            raise OutputDirInUse(
                f"{self.output_dir} already holds a run; pass --resume to continue it or choose "
                "another --output")

    # --- lifecycle ----------------------------------------------------------------------------

    def run(self) -> list[dict]:
        """Run the job; returns the metrics records of its iterations (metrics.jsonl also holds
        iteration 0, the initial policy's evaluation, when evaluation.at_start is on)."""
        if self.resume_from is not None and self.resume_from.iteration >= self.cfg.iterations:
            logger.info("%s already finished all %d iterations", self.output_dir, self.cfg.iterations)
            records = self.metrics.read()
            self._last_evaluation = _last_evaluation(records)
            if records and not self.show_progress:
                # A retry can start after the previous attempt finished (the worker was lost as
                # the last iteration ended): say where the run is, or the operator would keep the
                # previous attempt's last line, an iteration short.
                self._report_progress(records[-1])
            return _iteration_records(records)
        cluster.connect(self.cfg)
        for attempt in range(self.max_restarts + 1):
            try:
                start_iteration = self._start()
                self._loop(start_iteration)
                break
            except WORKER_DEATHS as error:
                # A worker process or dock actor died (killed, out of memory, node lost): restart
                # every worker and the dock from the last checkpoint. Errors raised by our own code
                # are not retried: they would fail the same way again.
                if attempt == self.max_restarts:
                    raise
                logger.warning("a worker died (%s); restart %d of %d from the last checkpoint",
                               error, attempt + 1, self.max_restarts)
                self._keep_inflight()
                self.resume_from = ckpt.latest_checkpoint(self.output_dir)
            finally:
                self._stop()
        records = self.metrics.read()
        plot_progress(records, self.output_dir / PLOT_FILE)
        return _iteration_records(records)

    def _start(self) -> int:
        cfg = self.cfg
        algo = cfg.algorithm
        # The devices before the dock: after a lost worker pod, Ray has the replacement node only
        # once this reservation is ready, and the dock's warehouses go on the worker nodes alive
        # when it starts (the head alone would get them).
        self._placement = cluster.reserve(cluster.job_placement(cfg, self.recipe))
        # Two banks when the next iteration's samples are put while this one's still train.
        self.banks = DockBanks([
            TransferDock.create(cfg.dock, states={s: list(c) for s, c in self.recipe.consumes.items()},
                                num_samples=cfg.num_samples_per_iteration,
                                group_size=algo.num_responses_per_prompt,
                                token_columns=TOKEN_COLUMNS,
                                # the staleness bound (dock.max_staleness) guards what trains
                                bounded_states=[self.recipe.update_state])
            for _ in range(2 if self.runs_ahead else 1)])
        self.dock = self.banks.bank(0)
        policy_dir = self.reference_dir
        start_iteration = 1
        if self.resume_from is not None:
            state = self.resume_from.state()
            policy_dir = self.resume_from.policy_dir
            start_iteration = self.resume_from.iteration + 1
            self.sampler.load_state_dict(state["sampler"])
            logger.info("resuming after iteration %d from %s", self.resume_from.iteration, self.resume_from.path)
        # Records after the last checkpoint belong to iterations that will be redone.
        self._last_evaluation = _last_evaluation(self.metrics.truncate_after(start_iteration - 1))
        adapter_dir = None
        if cfg.training.lora is not None and self.resume_from is not None:
            # LoRA: the actors load the base model and the trained adapters on top of it.
            policy_dir, adapter_dir = self.reference_dir, str(self.resume_from.path / ADAPTER_DIR)
        self.workers = self._create_workers(str(policy_dir), adapter_dir=adapter_dir,
                                            policy_version=start_iteration - 1)
        if self.resume_from is not None:
            rng = torch.load(self.resume_from.path / "rng.pt")
            ray.get([a.load_optimizer.remote(str(self.resume_from.optimizer_file)) for a in self.workers.actors])
            ray.get([a.set_rng_state.remote(rng["actors"][i]) for i, a in enumerate(self.workers.actors)])
            ray.get([c.load.remote(str(self.resume_from.path)) for c in self.workers.critics])
        return start_iteration

    def _create_workers(self, policy_dir: str, *, adapter_dir: str | None = None,
                        policy_version: int) -> WorkerGroups:
        cfg, banks = self.cfg, self.banks
        dp = cfg.training.data_parallel_size
        plan = cluster.job_placement(cfg, self.recipe)
        group = self._placement  # reserved by _start

        def seated(cls, seat):
            return cluster.seated(cls, group=group, plan=plan, seat=seat)

        num_actor_ranks = len(plan.actors)  # TP x DP; each rank a generation replica on its own device
        actors = [seated(ActorWorker, seat).remote(
            cfg, rank=r, world_size=num_actor_ranks, policy_dir=policy_dir, banks=banks, adapter_dir=adapter_dir,
            policy_version=policy_version)
            for r, seat in enumerate(plan.actors)]
        # none when kl_coef is 0 (job_recipe) or under LoRA (the actors run the reference pass)
        references = [seated(ReferenceWorker, seat).remote(
            cfg, rank=r, reference_dir=str(self.reference_dir), banks=banks) for r, seat in enumerate(plan.references)]
        assert len(references) in (0, dp), "one reference rank per DP rank, or none"
        states = self.recipe.states
        reward = advantage = None
        if "reward" in states:
            reward = cluster.remote(RewardWorker, num_cpus=0).remote(
                cfg, tokenizer_dir=str(self.reference_dir), banks=banks, train_files=self.data_files.train)
        if "advantage" in states:
            advantage = cluster.remote(AdvantageWorker, num_cpus=0).remote(cfg, banks=banks)
        # The critic starts from the initial policy's body, whatever policy the actors resume from.
        critics = [seated(CriticWorker, seat).remote(cfg, policy_dir=str(self.reference_dir), banks=banks, rank=r,
                                                     world_size=len(plan.critics))
                   for r, seat in enumerate(plan.critics)]
        reward_model = None
        if plan.reward_model is not None:
            reward_model = seated(RewardModelWorker, plan.reward_model).remote(
                cfg, tokenizer_dir=str(self.reference_dir), banks=banks)
        groups = WorkerGroups(actors, references, reward=reward, advantage=advantage, critics=critics,
                              reward_model=reward_model, generation_tp=cfg.rollout.tensor_parallel_size)
        logger.info("rollout engines on actor ranks %s, their TP workers on devices (bundles) %s "
                    "(rollout.tensor_parallel_size %d)", list(range(0, len(actors), groups.generation_tp)),
                    plan.engine_devices(groups.generation_tp), groups.generation_tp)
        # Each engine rank sees its replica's devices before its engine starts (replica_devices).
        engine_envs = engine_environments(ray.get([a.device_seat.remote() for a in actors]),
                                          generation_tp=groups.generation_tp)
        rendezvous = ray.get(actors[0].pick_rendezvous.remote())
        ray.get([a.join_group.remote(rendezvous, engine_envs.get(r)) for r, a in enumerate(actors)])
        if critics:  # the critic ranks' own DDP group
            rendezvous = ray.get(critics[0].pick_rendezvous.remote())
            ray.get([c.join_group.remote(rendezvous) for c in critics])
        self._turns = hand_out_turns(cfg, plan, self.recipe, groups)  # fresh with every new set of workers
        return groups

    def _stop(self) -> None:
        if self.workers is not None:
            for handle in self.workers.all():
                ray.kill(handle)
        if self._turns is not None:
            ray.kill(self._turns)
            self._turns = None
        if self._placement is not None:  # after the workers: their devices go back to the cluster
            cluster.release(self._placement)
        if self.banks is not None:
            self.banks.shutdown()
        self.workers, self.dock, self.banks, self._last_dock_stats = None, None, None, {}
        self._placement = None
        self._ahead = None
        self._inflight = None  # a later attempt's failure must not save this attempt's iteration

    # --- iterations ---------------------------------------------------------------------------

    def _loop(self, start_iteration: int) -> None:
        total = self.cfg.iterations
        # The initial policy's evaluation is logged as iteration 0, once per run.
        evaluate_at_start = (self.evaluator is not None and self.cfg.evaluation.at_start and start_iteration == 1
                             and not any(r["iteration"] == 0 for r in self.metrics.read()))
        tensorboard = TensorBoardLog(self.output_dir, first_step=0 if evaluate_at_start else start_iteration)
        progress = _progress_bar(total, start_iteration - 1, enabled=self.show_progress,
                                 desc=self.cfg.algorithm.name.upper())
        self._bookkeeping = Bookkeeper(background=self.cfg.training.background_bookkeeping)
        self._counters = None  # a failed counters read of an earlier attempt is not this attempt's
        self._last_iteration_end = None
        failed = True
        try:
            if evaluate_at_start:
                self._log(tensorboard, {"iteration": 0, **self._evaluate(0)})
            for iteration in range(start_iteration, total + 1):
                record = self._run_iteration(iteration)
                if self._evaluation_due(iteration):  # after the update: the engines hold its weights
                    record.update(self._evaluate(iteration))
                self._log(tensorboard, record)
                if iteration % self.cfg.checkpoint.interval == 0 or iteration == total:
                    self._save_checkpoint(iteration)
                key = headline_key(record)
                val = {"val": f"{self._last_evaluation['val/reward']:.3f}"} if self._last_evaluation else {}
                progress.set_postfix(**{key: f"{record[key]:.3f}"}, kl=f"{record['kl']:.4f}",
                                     tps=f"{record['tokens_per_s_per_device']:.0f}", **val, refresh=False)
                progress.update(1)
                if not self.show_progress:  # the bar is for people, the lines for the operator
                    self._report_progress(record)
            failed = False
        finally:
            progress.close()
            try:
                # Every finished iteration's record reaches the files, also on failure; then the
                # loop's own error is the one raised (a bookkeeping error is only logged).
                self._bookkeeping.close(raise_errors=not failed)
            finally:
                self._counters = None
                tensorboard.close()

    def _log(self, tensorboard: TensorBoardLog, record: dict) -> None:
        self._bookkeeping.later(self._write_record, tensorboard, record)
        if val_metrics(record):
            self._last_evaluation = record

    def _write_record(self, tensorboard: TensorBoardLog, record: dict) -> None:
        """Append `record` to metrics.jsonl and TensorBoard, its dock traffic read by then (its
        "dock" is the Future of `_dock_traffic` until here)."""
        if "dock" in record:  # iteration 0 (the initial policy's evaluation) moved no sample
            try:
                record["dock"] = record["dock"].result()
            except (DockActorDiedError, DockTimeoutError, ray.exceptions.RayError) as error:
                # The record is written without its traffic; the error itself is raised where the
                # driver waits for the counters (its next put), which fails the attempt.
                logger.warning("iteration %d's dock counters could not be read (%s)", record["iteration"], error)
                del record["dock"]
        self.metrics.append(record)
        tensorboard.append(record)

    def _evaluation_due(self, iteration: int) -> bool:
        interval = self.cfg.evaluation.interval
        return interval > 0 and (iteration % interval == 0 or iteration == self.cfg.iterations)

    def _evaluate(self, iteration: int) -> dict[str, float]:
        return self.evaluator.run(self.workers.engine_actors, iteration=iteration)

    def _report_progress(self, record: dict) -> None:
        """One machine-readable line per iteration on stdout; the operator reads it from the Ray
        job log (it runs jobs with --no-progress)."""
        latest = ckpt.latest_checkpoint(self.output_dir)
        headline = {**_headline(record), "iteration": record["iteration"], "iterations": self.cfg.iterations,
                    "checkpoint": latest.iteration if latest else None,
                    **evaluation_headline(self._last_evaluation)}
        print(format_progress(headline), flush=True)

    def _run_iteration(self, iteration: int) -> dict:
        cfg, algo = self.cfg, self.cfg.algorithm
        started = time.perf_counter()
        self._inflight = inflight = _Inflight(iteration)
        self.dock = self.banks.bank(iteration)
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # put and launched while the previous iteration's update ran
            assert ahead.iteration == iteration, "the pipeline ran ahead to another iteration"
            fed, put_seconds, sampled, futures = ahead.fed, ahead.put_seconds, SampledRounds(ahead.fed, {}, {}), \
                ahead.futures
        else:
            fed, put_seconds, sampled = self._fill_dock(iteration)
            if inflight.skip and self._turns is not None:  # their turns are not taken again
                ray.get(self._turns.skip.remote(iteration, sorted(inflight.skip)))
            futures = self._launch(iteration, self._before_update_states(), skip=inflight.skip)
        if self.runs_ahead and iteration < cfg.iterations:
            self._ahead = self._run_ahead(iteration + 1)
        # Calls to one actor run in submission order: the update goes after the run-ahead's
        # generation. After a failure, stages whose every rank had finished are not run again.
        futures.update(self._launch(iteration, self._update_states(), skip=inflight.skip))
        if self._ahead is not None and self._ahead.held is not None:  # partial rollout: after the update that cut it
            self._ahead.futures.update(self._launch_after_cut(self._ahead.iteration, self._ahead.held))
        prompt_lengths = fed.prompt_lengths
        inflight.launched.update({state: len(refs) for state, refs in futures.items()})
        gathered = _gather_failing_fast(futures, finished=inflight.finished)
        results = {**sampled.results, **{s: sampled.results.get(s, []) + r for s, r in gathered.items()}}
        ended = time.perf_counter()
        seconds = ended - started
        # End to end: this iteration and the driver's work since the previous one ended (bookkeeping
        # run inline or waited for, the next draw and reset), which `seconds` leaves out.
        cycle = None if self._last_iteration_end is None else ended - self._last_iteration_end
        self._last_iteration_end = ended
        # The update made policy version `iteration`: apply the staleness bound to what is left,
        # in the next iteration's bank too when it is already filling. Synchronous training has
        # nothing left to bound and no stage running: it goes in the bookkeeping's order, before
        # the counters read that the next put waits for. Async mode's next update must see it first.
        if self.runs_ahead:
            self._advance_policy(iteration)
        else:
            self._bookkeeping.later(self._advance_policy, iteration)
        ckpt.clear_inflight(self.output_dir)  # this iteration's work is done: nothing to resume

        rewards = [x for r in results.get("reward", []) for x in r["rewards"]]
        rollouts = results.get("rollout", []) + results.get(RESUME_STATE, [])  # partial rollout's two rounds
        response_lengths = [x for r in rollouts for x in r["response_lengths"]]
        response_lengths = response_lengths or fed.response_lengths  # DPO: the driver's responses
        updates = results[self.recipe.update_state]
        prompt_length = statistics.fmean(prompt_lengths)
        response_length = statistics.fmean(response_lengths)
        # A stage's time is its slowest rank's busy time (moving data + computing); waiting for
        # upstream stages is excluded, since all stages run at once and overlap.
        timing = {stage: max(r["dispatch_s"] + r["compute_s"] for r in rs) for stage, rs in results.items()}
        # compute: of that, the slowest rank's own work (model passes, scoring), without the dock.
        timing.update({f"compute/{stage}": max(r["compute_s"] for r in rs) for stage, rs in results.items() if rs})
        # dispatch: all time spent moving samples through the dock, summed over every worker.
        timing["dispatch"] = put_seconds + sum(r["dispatch_s"] for rs in results.values() for r in rs)
        timing["iteration"] = seconds
        if cycle is not None:  # the loop's first iteration has no previous end
            timing["cycle"] = cycle
        # idle: how long each state's ranks (mean over them) waited on the dock for upstream samples.
        timing.update({f"idle/{stage}": statistics.fmean(r.get("wait_s", 0.0) for r in rs)
                       for stage, rs in results.items() if rs})
        reward_stats = {"reward_mean": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards)} \
            if rewards else {}
        return {
            "iteration": iteration,
            **reward_stats,
            **merge_reward_metrics([r["reward_metrics"] for r in results.get("reward", [])]),
            "response_length_mean": response_length,
            "prompt_length_mean": prompt_length,
            **_update_metrics(updates),
            "tokens_per_s_per_device": tokens_per_s_per_device(
                num_prompts=algo.num_prompts_per_iteration, num_responses=algo.num_responses_per_prompt,
                prompt_length=prompt_length, response_length=response_length,
                num_devices=cfg.training.data_parallel_size * cfg.training.tensor_parallel_size, seconds=seconds),
            **_critic_metrics(results.get("critic_inference", []), results.get("critic_update", [])),
            # one rollout result per engine (DAPO's rounds are merged per worker)
            **({"rollout/num_engines": len(results["rollout"])} if results.get("rollout") else {}),
            **_per_rank_metrics(updates),
            **sampled.metrics,
            **(partial_metrics(rollouts) if cfg.rollout.partial_rollout != "off" else {}),
            **self._data_metrics(iteration),
            "timing": timing,
            # a Future until _write_record: read while the driver starts the next iteration
            "dock": self._read_counters(self.dock),
            # serial phase schedule: each shared device's phases, start and end (s)
            **({"phases": ray.get(self._turns.timeline.remote(iteration))} if self._turns is not None else {}),
        }

    def _data_metrics(self, iteration: int) -> dict:
        """The prompt set's size and the over-long prompts it dropped, in the first record only."""
        if iteration != 1:
            return {}
        return {"data/num_prompts": len(self.dataset), "data/dropped_prompts": self.dataset.num_dropped}

    def _update_states(self) -> tuple[str, ...]:
        """The recipe's launched states that train (the policy's and the critic's update)."""
        return tuple(s for s in self.recipe.launched_states if s in (self.recipe.update_state, "critic_update"))

    def _before_update_states(self) -> tuple[str, ...]:
        """The launched states that may run before the previous iteration's update (in recipe order)."""
        return tuple(s for s in self.recipe.launched_states if s not in self._update_states())

    def _launch(self, iteration: int, states: Sequence[str], *, skip: set[str] = frozenset(),
                round_tokens: int | None = None) -> dict[str, list]:
        launch = self._launchers(iteration, round_tokens=round_tokens)
        return {state: launch[state]() for state in states if state not in skip}

    def _run_ahead(self, iteration: int) -> _Ahead:
        """Async mode: put `iteration`'s prompts into its bank and launch its stages but the update,
        before the running iteration's update (the checkpoint keeps the sampler from before this draw).
        With partial rollout its generation is cut at rollout.max_tokens_per_round, and the passes the
        actor ranks run over its responses are held back until after the update (`_launch_after_cut`):
        queued before it, they would wait for responses only the second round writes."""
        sampler_state = self.sampler.state_dict()
        fed = self._draw()
        put_seconds = self._put(fed, self.banks.bank(iteration))
        states, held = self._before_update_states(), None
        if self.cfg.rollout.partial_rollout != "off":
            actor_states = {"actor_inference"} | (set() if self.workers.references else {"reference"})
            held = tuple(s for s in states if s in actor_states)
        futures = self._launch(iteration, [s for s in states if s not in (held or ())],
                               round_tokens=self.cfg.rollout.max_tokens_per_round)
        return _Ahead(iteration, fed, put_seconds, futures, sampler_state, held)

    def _launch_after_cut(self, iteration: int, held: Sequence[str]) -> dict[str, list]:
        """Partial rollout: the second round of `iteration`'s generation, then the held-back states."""
        futures = {RESUME_STATE: [a.finish_rollout.remote(iteration) for a in self.workers.engine_actors]}
        return {**futures, **self._launch(iteration, held)}

    def _launchers(self, iteration: int, sampling_round: int = 0, round_tokens: int | None = None) -> dict:
        """State -> a function that starts it on its workers and returns the futures."""
        w = self.workers
        return {
            "rollout": lambda: [a.generate.remote(iteration, sampling_round, round_tokens) for a in w.engine_actors],
            "actor_inference": lambda: [a.compute_old_logprobs.remote(iteration) for a in w.actors],
            # Under LoRA the actor ranks run it (their model with its adapters off): no reference ranks.
            "reference": lambda: [r.compute_ref_logprobs.remote(iteration) for r in (w.references or w.actors)],
            "reward": lambda: [w.reward.compute_rewards.remote(iteration)],
            REWARD_MODEL_STATE: lambda: [w.reward_model.compute_scores.remote(iteration)],
            "advantage": lambda: [w.advantage.compute_advantages.remote(iteration)],
            "update": lambda: [a.update.remote(iteration) for a in w.actors],
            "critic_inference": lambda: [c.compute_values.remote(iteration) for c in w.critics],
            "critic_update": lambda: [c.update.remote(iteration) for c in w.critics],
            "preference_update": lambda: [a.preference_update.remote(iteration) for a in w.actors],
        }

    def _advance_policy(self, version: int) -> None:
        for dock in self.banks.docks:
            dock.set_policy_version(version)

    def _read_counters(self, dock: TransferDock):
        """The Future of `dock`'s traffic since its last read; the driver's next put waits for it
        (`_put_groups`), so the counters hold exactly this iteration's traffic."""
        self._counters = self._bookkeeping.later(self._dock_traffic, dock)
        return self._counters

    def _dock_traffic(self, dock: TransferDock) -> dict:
        bank = self.banks.docks.index(dock)  # each bank's counters advance only with its iterations
        stats = dock.stats()
        traffic = dock_traffic(self._last_dock_stats.get(bank), stats)
        self._last_dock_stats[bank] = stats
        return traffic

    def _draw(self, num_prompts: int | None = None) -> DriverBatch:
        """The recipe's batch (prompt groups or preference pairs) for the next `num_prompts` prompts
        (default G)."""
        algo = self.cfg.algorithm
        build = BATCH_BUILDERS.get(self.recipe.driver_batch)
        count = algo.num_prompts_per_iteration if num_prompts is None else num_prompts
        return build(self.dataset, self.sampler.next_batch(count), self.tokenizer, algo)

    def _keep_inflight(self) -> None:
        """After a worker died: stop the workers, then keep the dock of the iteration in flight for
        its retry (ckpt.save_inflight), unless the dock died too."""
        inflight = self._inflight
        if self.dock is None or inflight is None or self.recipe.sampling_rounds is not None or self.runs_ahead:
            # Sampling rounds (DAPO) refill the dock each round, and the async pipeline has two
            # iterations in flight: such an iteration is redone whole from the checkpoint.
            return
        if self.workers is not None:
            for handle in self.workers.all():  # no writer may run while the dock is read
                ray.kill(handle)
            self.workers = None
        try:
            state = self.dock.state_dict()
        except DockActorDiedError as error:
            logger.warning("the dock died too (%s); iteration %d will be redone from its start", error,
                           inflight.iteration)
            return
        path = ckpt.save_inflight(self.output_dir, iteration=inflight.iteration, dock_state=state,
                                  finished=inflight.finished, launched=inflight.launched)
        logger.info("kept the dock of iteration %d in %s for its retry", inflight.iteration, path)

    def _resume_inflight(self, fed: DriverBatch, snapshot: dict) -> tuple[float, SampledRounds]:
        """Load the dock an earlier attempt of this iteration left (instead of putting `fed`, the same
        prompts: the sampler resumed from the same checkpoint). Samples a stage took without its
        outputs reaching the dock go back to it; stages whose every rank finished are not run
        again and their results are reused. States that write nothing (the update) always run:
        their effect, the weights, was lost with the worker."""
        started = time.perf_counter()
        produces = self.recipe.produces
        self.dock.reset()
        self.dock.load_state_dict(snapshot["dock"], produces=produces)
        finished, launched = snapshot["finished"], snapshot["launched"]
        reruns = {state for state in self.recipe.launched_states if not produces.get(state)}
        kept = {state: results for state, results in finished.items() if state not in reruns}
        skip = {state for state, results in kept.items() if len(results) == launched.get(state)}
        # Partly finished stages run again on every rank; the ranks that had finished find their
        # work done, so the results that came back then are joined with the new ones (in the
        # metrics; a second failure keeps only the stages finished whole).
        self._inflight.skip = skip
        self._inflight.finished.update({state: list(kept[state]) for state in skip})
        self._inflight.launched.update({state: launched[state] for state in skip})
        logger.info("iteration %d resumes from the dock of its failed attempt; not run again: %s",
                    self._inflight.iteration, sorted(self._inflight.skip))
        return time.perf_counter() - started, SampledRounds(fed, kept, {})

    def _put(self, fed: DriverBatch, dock: TransferDock | None = None) -> float:
        dock = self.dock if dock is None else dock
        started = time.perf_counter()
        dock.reset()
        self._put_groups(torch.arange(len(fed.batch) // self.cfg.algorithm.num_responses_per_prompt), fed, dock)
        return time.perf_counter() - started

    def _put_groups(self, groups: torch.Tensor, fed: DriverBatch, dock: TransferDock | None = None) -> None:
        """The driver's rows of group slots `groups` into `dock` (the current one by default): what
        every sample of a group shares (the prompt) crosses the network once per group, not once
        per sample (dock/grouping.py)."""
        shared, per_sample = split_group_columns(fed.batch, self.cfg.algorithm.num_responses_per_prompt)
        if self._counters is not None:  # the last iteration's counters, read before this write counts
            self._counters.result()
        (self.dock if dock is None else dock).put_groups(groups, shared, samples=per_sample)

    def _fill_dock(self, iteration: int) -> tuple[DriverBatch, float, SampledRounds]:
        """Put the iteration's batch into the dock: G fresh prompts, or with sampling rounds
        (DAPO) the groups of those rounds, refilling the slots of dropped groups. Returns the batch,
        the seconds spent putting and the rounds' results and metrics (empty without rounds)."""
        rounds = self.recipe.sampling_rounds
        if rounds is None:
            fed = self._draw()
            snapshot = ckpt.load_inflight(self.output_dir, iteration)
            if snapshot is not None and self.dock.can_load(snapshot["dock"]):
                return fed, *self._resume_inflight(fed, snapshot)
            return fed, self._put(fed), SampledRounds(fed, {}, {})
        algo = self.cfg.algorithm
        put_seconds = 0.0

        def run_round(groups: torch.Tensor, fresh: DriverBatch, sampling_round: int):
            """Fresh prompt groups into the dock's group slots `groups`, emptied first (the groups
            the filter dropped; the first round starts the iteration), then the sampling states;
            only the filter's (B,) score column comes back to the driver."""
            nonlocal put_seconds
            rows = group_rows(groups, algo.num_responses_per_prompt)  # (k*N,)
            started = time.perf_counter()
            if sampling_round == 0:
                self.dock.reset()
            else:
                self.dock.recycle(rows)
            self._put_groups(groups, fresh)
            put_seconds += time.perf_counter() - started
            launch = self._launchers(iteration, sampling_round)
            results = _gather_failing_fast({state: launch[state]() for state in rounds.states})
            indices, scored = self.dock.get(rounds.read_state, [rounds.score_column], batch_size=len(rows),
                                            whole_groups=True)
            assert torch.equal(indices, rows), "the filter state must get exactly this round's rows"
            return results, scored[rounds.score_column]

        sampled = DynamicSampling(num_groups=algo.num_prompts_per_iteration,
                                  group_size=algo.num_responses_per_prompt,
                                  max_rounds=algo.dapo.max_sampling_rounds,
                                  group_filter=rounds.group_filter(algo)).run(self._draw, run_round)
        # The kept groups (and any padding) are in the dock already: nothing more to put.
        return sampled.batch, put_seconds, sampled

    def _save_checkpoint(self, iteration: int) -> None:
        # The records up to this iteration are in metrics.jsonl before the checkpoint commits: a
        # resume keeps only the records up to its checkpoint, and redoes none of these.
        self._bookkeeping.wait()
        staging = ckpt.staging_dir(self.output_dir, iteration)
        ray.get([a.save.remote(str(staging)) for a in self.workers.actors])
        actor_rng = ray.get([a.get_rng_state.remote() for a in self.workers.actors])
        torch.save({"actors": actor_rng}, staging / "rng.pt")
        ray.get([c.save.remote(str(staging)) for c in self.workers.critics])  # rank 0 writes
        # The driver draws no random numbers itself: the sampler's state is the data position, the
        # ranks' torch RNG covers training, and sampling seeds derive from (seed, iteration, index).
        # Async mode drew the next iteration's prompts already: keep the position before that draw.
        state = {"sampler": self._ahead.sampler_state if self._ahead is not None else self.sampler.state_dict()}
        ckpt.commit(self.output_dir, staging, iteration, state, keep_last=self.cfg.checkpoint.keep_last)
        plot_progress(self.metrics.read(), self.output_dir / PLOT_FILE)


@dataclass
class _Inflight:
    """What an iteration has done so far: results of stage ranks that returned, ranks per stage."""

    iteration: int
    finished: dict[str, list[dict]] = field(default_factory=dict)
    launched: dict[str, int] = field(default_factory=dict)
    skip: set[str] = field(default_factory=set)  # stages a resumed iteration does not run again


@dataclass
class _Ahead:
    """Async mode: an iteration put into its bank and launched (all but its update) ahead."""

    iteration: int
    fed: DriverBatch
    put_seconds: float
    futures: dict[str, list]  # state -> the futures of its ranks
    sampler_state: dict  # the sampler before this iteration's draw, for the checkpoint before it
    # partial rollout: the states launched only after the update that cut the generation; None: not cut
    held: tuple[str, ...] | None = None


def _gather_failing_fast(futures: dict[str, list], finished: dict[str, list[dict]] | None = None
                         ) -> dict[str, list[dict]]:
    """ray.get of every stage, raising the first worker error at once instead of waiting for the
    other stages to time out on data that will never come."""
    stage_of = {ref: stage for stage, refs in futures.items() for ref in refs}
    pending = list(stage_of)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            result = ray.get(done[0])  # raises the worker's exception, naming the actor and stage
        except ray.exceptions.RayTaskError as error:
            # A rank whose collective peer was killed fails at once (connection reset) while Ray
            # still reports the death: the death is the cause, and only it is retried (run()).
            raise _dead_worker_error(pending) or error
        if finished is not None:
            finished.setdefault(stage_of[done[0]], []).append(result)
    return {stage: ray.get(refs) for stage, refs in futures.items()}


# What run() restarts from (--max-restarts): a worker's process or a dock actor died (a lost node
# takes both, and whichever the driver calls first reports it).
WORKER_DEATHS = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, DockActorDiedError)
DEAD_WORKER_GRACE_S = 5.0  # how long a stage error waits for Ray to report a dead worker behind it


def _dead_worker_error(pending: list) -> Exception | None:
    """The error of a worker that died among `pending` futures, as Ray reports it within the grace."""
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=DEAD_WORKER_GRACE_S) if pending else ([], [])
    for ref in ready:
        try:
            ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as died:
            return died
        except ray.exceptions.RayTaskError:
            continue  # another stage's own error: not a death
    return None


# Update results whose values are dicts named per rank (the resharding memory ledger and times):
# merged over ranks, not averaged.
PER_RANK_KEYS = ("ledger", "resharding")


def _update_metrics(updates: list[dict]) -> dict:
    """Mean over ranks of every training metric the update stage returned (not its timing)."""
    skip = {"wait_s", "dispatch_s", "compute_s", "num_samples", *PER_RANK_KEYS}
    return {key: statistics.fmean(u[key] for u in updates) for key in updates[0] if key not in skip}


def _per_rank_metrics(updates: list[dict]) -> dict:
    """{"ledger": {"memory/rank{r}/...": ...}, ...} merged over the ranks that returned them."""
    merged = {key: {name: value for u in updates for name, value in u.get(key, {}).items()}
              for key in PER_RANK_KEYS}
    return {key: values for key, values in merged.items() if values}


def _critic_metrics(inferences: list[dict], updates: list[dict]) -> dict:
    """The critic's training metrics, mean over its ranks (as the actor's), and per rank
    (`critic_ranks/rank{r}/...`) the samples it took in each stage and its weights' sum after the
    update (equal on every rank while DDP keeps them in step)."""
    if not updates:
        return {}
    keys = ("value_loss", "value_clip_fraction", "value_mean", "value_grad_norm")
    ranks: dict[str, dict[str, float]] = {}
    for stage, results in (("inference_samples", inferences), ("update_samples", updates)):
        for result in results:
            rank = ranks.setdefault(f"rank{result['rank']}", {"inference_samples": 0, "update_samples": 0})
            rank[stage] += result["num_samples"]
            if "weights_sum" in result:
                rank["weights_sum"] = result["weights_sum"]
    return {**{key: statistics.fmean(u[key] for u in updates) for key in keys}, "critic_ranks": ranks}


def _headline(record: dict) -> dict:
    # DPO records have no sampled reward; its preference accuracy stands in (metrics.headline_key).
    keys = (headline_key(record), "kl", "loss", "response_length_mean", "tokens_per_s_per_device")
    return {k: round(record[k], 4) for k in keys}


def _progress_bar(total: int, initial: int, *, enabled: bool, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="it", disable=not enabled, dynamic_ncols=True)


def _iteration_records(records: list[dict]) -> list[dict]:
    return [r for r in records if r["iteration"] > 0]


def _last_evaluation(records: list[dict]) -> dict | None:
    """The newest record that holds an evaluation's val/ metrics, or None."""
    return next((r for r in reversed(records) if val_metrics(r)), None)


def heldout_evaluation(cfg: JobConfig, tokenizer, val_files: Sequence[str]) -> Evaluator | None:
    """The evaluator of a job: its held-out prompts (`val_files`: data.val_files, or the generator's
    val split), rendered, tokenized and length-checked exactly like the train prompts, and the job's
    reward terms to score them; None when evaluation is off."""
    if cfg.evaluation.interval == 0:
        return None
    rows = load_rows(val_files, columns_of(cfg.data), field="data.val_files")
    dataset = PromptDataset(rows, tokenizer=tokenizer, spec=cfg.data,
                            max_prompt_length=cfg.algorithm.max_prompt_length)
    positions = range(min(len(dataset), cfg.evaluation.max_prompts or len(dataset)))
    examples = [EvalExample(prompt=e.prompt, ground_truth=e.ground_truth, data_source=e.data_source,
                            extra_info=e.extra_info) for e in dataset.examples(positions)]
    # The driver holds no reward model: held-out responses are scored by the other terms only
    # (config/problems.py refuses evaluation in a job whose only term is `model`).
    scorer = RewardScorer(cfg.reward.model_copy(update={"terms": [t for t in cfg.reward.terms if t.name != "model"]}))

    def score(responses: list[str], scored: list[EvalExample]) -> list[float]:
        return scorer.score(responses, [e.ground_truth for e in scored], [e.data_source for e in scored],
                            [e.extra_info for e in scored]).scores.tolist()

    return Evaluator(examples, score, prompt_ids=dataset.prompt_ids(positions), tokenizer=tokenizer,
                     spec=cfg.evaluation, max_response_length=cfg.algorithm.max_response_length)
