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

The order of an iteration's calls is its schedule's (runtime/schedule/): one iteration at a time,
or with `training.mode: async` (and dock.max_staleness >= 1) the next iteration put into the other
dock bank and launched, all but its update, before this one's update, so its samples come from the
policy one version old (`staleness_mean`); partial rollout and DAPO's sampling rounds are parts
they compose. The trainer chooses the schedule once per attempt and keeps the lifecycle: workers,
checkpoints, evaluation, metrics records (metrics.iteration_record) and progress.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import string
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup

from rldock.config import JobConfig
from rldock.contract.placement import PlacementPlan
from rldock.contract.progress import evaluation_headline, format_progress
from rldock.runtime import checkpoint as ckpt
from rldock.runtime import cluster
from rldock.runtime.agent.conversation import ChatRenderer
from rldock.runtime.agent.loading import job_conversation
from rldock.runtime.agent.service.local import JobEnvironmentServers
from rldock.runtime.algorithms.recipes import job_recipe
from rldock.runtime.bookkeeping import Bookkeeper
from rldock.runtime.data import (
    DataFiles,
    PromptDataset,
    PromptSampler,
    Row,
    columns_of,
    load_rows,
    prepare_data_files,
    tokenizer_corpus,
    val_columns,
)
from rldock.runtime.dataflow import TOKEN_COLUMNS
from rldock.runtime.dock import DockActorDiedError, DockTimeoutError, TransferDock
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.engines.replica_devices import engine_environments
from rldock.runtime.evaluation import EvalExample, Evaluator, val_metrics
from rldock.runtime.iteration_hold import IterationHold
from rldock.runtime.metrics import PLOT_FILE, MetricsLog, dock_traffic, headline_key, iteration_record, plot_progress
from rldock.runtime.models import MODEL_BUILDERS
from rldock.runtime.models.loading import load_tokenizer
from rldock.runtime.planning.memory import compute_dtypes
from rldock.runtime.planning.shapes import shape_from_hf_config
from rldock.runtime.rewards import RewardScorer, column_lists
from rldock.runtime.sampling import BATCH_BUILDERS, DriverBatch
from rldock.runtime.schedule import WORKER_DEATHS, Driver, Schedule, choose_schedule, num_banks
from rldock.runtime.states import ACTOR, CRITIC, REFERENCE, WorkerContext, WorkerState, states_layout, worker_groups
from rldock.runtime.tracking import Tracking, open_tracking
from rldock.runtime.turns import hand_out_turns
from rldock.runtime.utilisation import UtilisationInputs, job_rates
from rldock.runtime.warmup import run_warmup
from rldock.runtime.workers.device_worker import distinct_processes, start_device_seats

logger = logging.getLogger(__name__)

WARMUP_DIR = "warmup"


class OutputDirInUse(RuntimeError):
    pass


def prepare_base_model(cfg: JobConfig, rows: list[Row]) -> Path:
    """The base model's directory, after building the tiny model there (with a tokenizer trained on
    the train rows) when `model.builder` asks for it and none exists yet."""
    base = Path(cfg.model.path)
    builder = cfg.model.builder
    if builder and not (base / "config.json").is_file():
        logger.info("building tiny model %s at %s", builder, base)
        texts = tokenizer_corpus(rows, cfg.data.system_prompt)
        if cfg.data.chat_template == "model":  # the template's, the tools' and their calls' characters
            texts.append(string.printable)
        # Room for a job's whole sequence (multi-turn trajectories are long); 64 for the demo's.
        positions = max(64, 1 << (cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length - 1).bit_length())
        _write_atomically(
            base,
            lambda tmp: MODEL_BUILDERS.get(builder)(tmp, texts=texts, seed=cfg.seed, max_position_embeddings=positions),
        )
    return base


def prepare_initial_policy(
    cfg: JobConfig, output_dir: Path, base: Path, dataset: PromptDataset, *, conversation: ChatRenderer | None = None
) -> Path:
    """Model dir the RL phase starts from (and the reference policy): the base model, after the
    supervised warm-up when one is configured (skipped when its output exists). `conversation`: an
    agent job's renderer, which lays its demonstrations out."""
    if cfg.warmup.steps == 0:
        return base
    warm = output_dir / WARMUP_DIR
    if not (warm / "config.json").is_file():
        logger.info("supervised warm-up: %d steps", cfg.warmup.steps)
        _write_atomically(
            warm,
            lambda tmp: run_warmup(
                base,
                tmp,
                dataset=dataset,
                spec=cfg.warmup,
                seed=cfg.seed,
                conversation=conversation,
                max_response_length=cfg.algorithm.max_response_length,
                micro_batch_size=cfg.training.micro_batch_size,
                micro_batch_tokens=cfg.training.micro_batch_tokens,
            ),
        )
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
    """The Ray actors of a job by worker group (rldock.runtime.states): only the groups the
    recipe's states run on exist (DPO has no reward or advantage worker, GRPO and DAPO no advantage
    worker where the reward computes it, only PPO and PF-PPO have critic ranks, only a job with a
    `model` reward term a reward model)."""

    ranks: dict[str, list]  # group name -> its Ray actors by rank
    generation_tp: int = 1  # rollout.tensor_parallel_size: actor ranks per generation replica

    @property
    def actors(self) -> list:
        return self.ranks.get(ACTOR.name, [])

    @property
    def references(self) -> list:
        return self.ranks.get(REFERENCE.name, [])

    @property
    def critics(self) -> list:
        return self.ranks.get(CRITIC.name, [])

    @property
    def engine_actors(self) -> list:
        """The actors holding a rollout engine: each generation replica's first rank."""
        return self.actors[:: self.generation_tp]

    def runners(self, spec: WorkerState) -> list:
        """The Ray actors that run `spec`'s state: every rank of its group, or the engine ranks."""
        assert spec.group is not None  # a state without a group runs on the driver, not on runners
        handles = self.ranks[spec.group.name]
        return handles[:: self.generation_tp] if spec.runs_on == "engines" else handles

    def all(self) -> list:
        """The job's worker processes (Ray actors), each once: a device worker holds several ranks."""
        return distinct_processes([handle for handles in self.ranks.values() for handle in handles])


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
        self.recipe = job_recipe(cfg)  # less the passes this config makes redundant
        self.layout = states_layout(cfg, self.recipe.specs)  # ranks, replicas, devices (rldock.contract.layout)
        if "reward" in self.recipe.states:
            RewardScorer(cfg.reward)  # fail fast (RewardError naming the term) before any model work
        self.data_files, rows = load_prompt_set(cfg, self.output_dir)
        base = prepare_base_model(cfg, rows)
        self.tokenizer = load_tokenizer(base)  # the warm-up saves the same tokenizer again
        conversation = job_conversation(cfg, self.tokenizer)  # an agent job's prompts describe its tools
        self.dataset = PromptDataset(
            rows,
            tokenizer=self.tokenizer,
            spec=cfg.data,
            max_prompt_length=cfg.algorithm.max_prompt_length,
            conversation=conversation,
        )
        logger.info(
            "prompt set: %d prompts from %s (%d dropped as longer than algorithm.max_prompt_length)",
            len(self.dataset),
            self.data_files.train,
            self.dataset.num_dropped,
        )
        shuffle_seed = cfg.seed if cfg.data.shuffle_seed is None else cfg.data.shuffle_seed
        self.sampler = PromptSampler(len(self.dataset), seed=shuffle_seed)
        self.reference_dir = prepare_initial_policy(cfg, self.output_dir, base, self.dataset, conversation=conversation)
        self.evaluator = heldout_evaluation(cfg, self.tokenizer, self.data_files.val, conversation=conversation)
        self._last_evaluation: dict | None = None  # the newest record holding val/ metrics
        self.resume_from = ckpt.latest_checkpoint(self.output_dir) if resume else None
        self.banks: DockBanks | None = None
        self.schedule: Schedule | None = None  # the order of each iteration's calls, chosen per attempt
        self.workers: WorkerGroups | None = None
        self._plan: PlacementPlan | None = None  # the placement plan (cluster.job_placement) of the devices
        self._placement: PlacementGroup | None = None  # the Ray placement group reserved for it
        self._turns: ActorHandle | None = None  # the TurnKeeper of a serial phase schedule (runtime/turns.py)
        # The environment servers this job starts itself (agent ... servers.command), per attempt.
        self._environment_servers: JobEnvironmentServers | None = None
        self._environment_urls: dict[str, list[str]] = {}
        self._last_dock_stats: dict[int, dict] = {}  # per bank: its cumulative stats when last read
        # Counters and metrics files, in a background thread while the next iteration starts
        # (JobConfig.ablations.background_bookkeeping; runtime/bookkeeping.py); a fresh one per _loop.
        self._bookkeeping = Bookkeeper(background=False)
        self._counters: Future | None = None  # the Future of the last counters read, awaited before the next put
        self._last_iteration_end: float | None = None  # perf_counter when the last iteration's stages ended
        self._hold = IterationHold.from_environ()  # test tooling: a no-op unless RLDOCK_TEST_HOLD_FILE is set
        self._utilisation: UtilisationInputs | None = None  # the mfu/ metrics' inputs, found once per run

    def _check_output_dir(self, resume: bool) -> None:
        if not resume and (self.metrics.path.exists() or ckpt.latest_checkpoint(self.output_dir)):
            raise OutputDirInUse(
                f"{self.output_dir} already holds a run; pass --resume to continue it or choose another --output"
            )

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
                logger.warning(
                    "a worker died (%s); restart %d of %d from the last checkpoint",
                    error,
                    attempt + 1,
                    self.max_restarts,
                )
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
        self._plan = cluster.job_placement(cfg, self.recipe)
        self._placement = cluster.reserve(self._plan)
        # Two banks when the next iteration's samples are put while this one's still train.
        self.banks = DockBanks(
            [
                TransferDock.create(
                    cfg.dock,
                    states={s: list(c) for s, c in self.recipe.consumes.items()},
                    num_samples=cfg.num_samples_per_iteration,
                    group_size=algo.num_responses_per_prompt,
                    token_columns=TOKEN_COLUMNS,
                    colocate_controllers=cfg.ablations.colocate_controllers,
                    shared_memory=cfg.ablations.shared_memory,
                    # the staleness bound (dock.max_staleness) guards what trains
                    bounded_states=[self.recipe.update_state],
                )
                for _ in range(num_banks(cfg))
            ]
        )
        # Before the workers, whose rollout engines open sessions on them.
        self._environment_servers = JobEnvironmentServers(cfg, log_dir=self.output_dir / "environments")
        self._environment_urls = self._environment_servers.start()
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
            policy_dir, adapter_dir = self.reference_dir, str(self.resume_from.adapter_dir)
        self.workers = self._create_workers(
            str(policy_dir), adapter_dir=adapter_dir, policy_version=start_iteration - 1
        )
        if self.resume_from is not None:
            rng = torch.load(self.resume_from.path / "rng.pt")
            ray.get([a.load_optimizer.remote(str(self.resume_from.optimizer_file)) for a in self.workers.actors])
            ray.get([a.set_rng_state.remote(rng["actors"][i]) for i, a in enumerate(self.workers.actors)])
            ray.get([c.load.remote(str(self.resume_from.path)) for c in self.workers.critics])
        self.schedule = choose_schedule(cfg, self._driver(), self.banks, actor_rank_states=self._actor_rank_states())
        if self._utilisation is None:
            self._utilisation = self._utilisation_inputs()
        return start_iteration

    def _utilisation_inputs(self) -> UtilisationInputs | None:
        """The model's shape and the device's rates for the `mfu/` metrics (runtime/utilisation.py):
        the rates the config sets, else those actor rank 0 measures on its device in each dtype the
        stages compute in (`rldock bench peak`'s cache, or a measurement of a few seconds now).
        None, with a warning, where the count cannot be made (a config.json without the fields it
        reads, a device whose peak cannot be measured): a metric never stops the job."""
        cfg, resources = self.cfg, self.cfg.resources
        config_file = self.reference_dir / "config.json"
        try:
            shape = shape_from_hf_config(json.loads(config_file.read_text()), name=cfg.model.path)
        except KeyError as missing:
            logger.warning(
                "no mfu/ metrics: %s has no %s, which the FLOP count reads (Llama/Qwen-style field names)",
                config_file,
                missing,
            )
            return None
        rollout, training, reference = compute_dtypes(cfg)
        dtypes = sorted({rollout, training, reference})
        if resources.peak_tflops is None:
            measuring = dtypes
        else:  # the bandwidth only: one measurement
            measuring = [rollout] if resources.memory_bandwidth_gbps is None else []
        found = ray.get(self._started().actors[0].device_rates.remote(measuring))
        if "unavailable" in found:
            logger.warning(
                "no mfu/ metrics: the device's peak could not be measured (%s); set resources.peak_tflops "
                "and resources.memory_bandwidth_gbps to have them",
                found["unavailable"],
            )
            return None
        return UtilisationInputs(
            shape=shape,
            rates=job_rates(
                peak_tflops=resources.peak_tflops,
                bandwidth_gbps=resources.memory_bandwidth_gbps,
                dtypes=dtypes,
                measured=found["measured"],
                device_kind=found["device_kind"],
            ),
            group_size=cfg.algorithm.num_responses_per_prompt,
            recompute=cfg.training.gradient_checkpointing,
            generation_tp=cfg.rollout.tensor_parallel_size,
            rollout_dtype=rollout,
            training_dtype=training,
            reference_dtype=reference,
        )

    def _create_workers(self, policy_dir: str, *, adapter_dir: str | None = None, policy_version: int) -> WorkerGroups:
        """The workers of every worker group the recipe's states run on (their specs,
        rldock.runtime.states): the device groups' ranks on their seats of the placement plan, the
        seats of one device in one process (workers/device_worker.py), the others one Ray actor per
        rank outside it; then each collective group joins its own process group."""
        cfg, plan, placement = self.cfg, self._plan, self._placement
        assert plan is not None and placement is not None  # reserved by _start
        context = WorkerContext(
            cfg=cfg,
            banks=self.banks,
            policy_dir=policy_dir,
            reference_dir=str(self.reference_dir),
            adapter_dir=adapter_dir,
            policy_version=policy_version,
            train_files=self.data_files.train,
            environment_urls=self._environment_urls,
        )
        specs = worker_groups(self.recipe.specs)
        seated = start_device_seats(
            {name: spec for name, spec in specs.items() if spec.device}, context, plan=plan, placement=placement
        )
        ranks = {}
        for name, spec in specs.items():
            if spec.device:
                ranks[name] = seated[name]
                continue
            num_ranks = spec.num_ranks(cfg)
            ranks[name] = [
                cluster.remote(spec.worker_class(), num_cpus=0).remote(**spec.arguments(context, rank, num_ranks))
                for rank in range(num_ranks)
            ]
        groups = WorkerGroups(ranks, generation_tp=cfg.rollout.tensor_parallel_size)
        actors = groups.actors
        logger.info(
            "rollout engines on actor ranks %s, their TP workers on devices (bundles) %s "
            "(rollout.tensor_parallel_size %d)",
            list(range(0, len(actors), groups.generation_tp)),
            plan.engine_devices(groups.generation_tp),
            groups.generation_tp,
        )
        # Each engine rank sees its replica's devices before its engine starts (replica_devices).
        engine_envs = engine_environments(
            ray.get([a.device_seat.remote() for a in actors]), generation_tp=groups.generation_tp
        )
        for name, spec in worker_groups(self.recipe.specs).items():
            handles = ranks[name]
            if spec.collective and handles:  # the group's own DDP group (the actor's also sets up engines)
                rendezvous = ray.get(handles[0].pick_rendezvous.remote())
                ray.get(
                    [
                        h.join_group.remote(rendezvous, *((engine_envs.get(r),) if name == ACTOR.name else ()))
                        for r, h in enumerate(handles)
                    ]
                )
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
        if self._environment_servers is not None:  # after the workers: no session is left to end
            self._environment_servers.stop()
            self._environment_servers = None
        self.workers, self.banks, self._last_dock_stats = None, None, {}
        self._placement = self._plan = None
        self.schedule = None  # a later attempt's failure must not save this attempt's iteration

    # --- iterations ---------------------------------------------------------------------------

    def _loop(self, start_iteration: int) -> None:
        total = self.cfg.iterations
        # The initial policy's evaluation is logged as iteration 0, once per run.
        evaluate_at_start = (
            self.evaluator is not None
            and self.cfg.evaluation.at_start
            and start_iteration == 1
            and not any(r["iteration"] == 0 for r in self.metrics.read())
        )
        tracking = open_tracking(self.cfg, self.output_dir, first_step=0 if evaluate_at_start else start_iteration)
        progress = _progress_bar(
            total, start_iteration - 1, enabled=self.show_progress, desc=self.cfg.algorithm.name.upper()
        )
        self._bookkeeping = Bookkeeper(background=self.cfg.ablations.background_bookkeeping)
        self._counters = None  # a failed counters read of an earlier attempt is not this attempt's
        self._last_iteration_end = None
        failed = True
        try:
            if evaluate_at_start:
                self._log(tracking, {"iteration": 0, **self._evaluate(0)})
            for iteration in range(start_iteration, total + 1):
                self._hold.wait_before(iteration)
                record = self._run_iteration(iteration)
                if self._evaluation_due(iteration):  # after the update: the engines hold its weights
                    record.update(self._evaluate(iteration))
                self._log(tracking, record)
                if iteration % self.cfg.checkpoint.interval == 0 or iteration == total:
                    self._save_checkpoint(iteration)
                key = headline_key(record)
                val = {"val": f"{self._last_evaluation['val/reward']:.3f}"} if self._last_evaluation else {}
                progress.set_postfix(
                    **{key: f"{record[key]:.3f}"},
                    kl=f"{record['kl']:.4f}",
                    tps=f"{record['tokens_per_s_per_device']:.0f}",
                    **val,
                    refresh=False,
                )
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
                tracking.close()

    def _log(self, tracking: Tracking, record: dict) -> None:
        self._bookkeeping.later(self._write_record, tracking, record)
        if val_metrics(record):
            self._last_evaluation = record

    def _write_record(self, tracking: Tracking, record: dict) -> None:
        """Append `record` to metrics.jsonl and the `tracking` logs, its dock traffic read by then (its
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
        tracking.append(record)

    def _evaluation_due(self, iteration: int) -> bool:
        interval = self.cfg.evaluation.interval
        return interval > 0 and (iteration % interval == 0 or iteration == self.cfg.iterations)

    def _evaluate(self, iteration: int) -> dict[str, float]:
        assert self.evaluator is not None  # called only with evaluation.interval > 0, which makes one
        return self.evaluator.run(self._started().engine_actors, iteration=iteration)

    def _report_progress(self, record: dict) -> None:
        """One machine-readable line per iteration on stdout; the operator reads it from the Ray
        job log (it runs jobs with --no-progress)."""
        latest = ckpt.latest_checkpoint(self.output_dir)
        headline = {
            **_headline(record),
            "iteration": record["iteration"],
            "iterations": self.cfg.iterations,
            "checkpoint": latest.iteration if latest else None,
            **evaluation_headline(self._last_evaluation),
        }
        print(format_progress(headline), flush=True)

    def _run_iteration(self, iteration: int) -> dict:
        cfg, algo = self.cfg, self.cfg.algorithm
        assert self.schedule is not None  # chosen by _start
        stages = self.schedule.run(iteration)
        # End to end: this iteration and the driver's work since the previous one ended (bookkeeping
        # run inline or waited for, the next draw and reset), which the iteration's own time leaves out.
        cycle = None if self._last_iteration_end is None else stages.ended - self._last_iteration_end
        self._last_iteration_end = stages.ended
        record = iteration_record(
            stages.results,
            iteration=iteration,
            update_state=self.recipe.update_state,
            prompt_lengths=stages.fed.prompt_lengths,
            driver_response_lengths=stages.fed.response_lengths,
            put_seconds=stages.put_seconds,
            seconds=stages.ended - stages.started,
            cycle=cycle,
            num_prompts=algo.num_prompts_per_iteration,
            num_responses=algo.num_responses_per_prompt,
            num_devices=self.layout.num_actor_ranks,
            partial_rollout=cfg.rollout.partial_rollout != "off",
            round_metrics=stages.round_metrics,
            data_metrics=self._data_metrics(iteration),
            utilisation=self._utilisation,
        )
        # a Future until _write_record: read while the driver starts the next iteration
        record["dock"] = self._read_counters(stages.bank)
        if self._turns is not None:  # serial phase schedule: each shared device's phases, start and end (s)
            record["phases"] = ray.get(self._turns.timeline.remote(iteration))
        return record

    def _data_metrics(self, iteration: int) -> dict:
        """The prompt set's size and the over-long prompts it dropped, in the first record only."""
        if iteration != 1:
            return {}
        return {"data/num_prompts": len(self.dataset), "data/dropped_prompts": self.dataset.num_dropped}

    def _update_states(self) -> tuple[str, ...]:
        """The recipe's launched states that train (their spec's `trains`: the policy's and the
        critic's update)."""
        return self.recipe.training_states

    def _before_update_states(self) -> tuple[str, ...]:
        """The launched states that may run before the previous iteration's update (in recipe order)."""
        return tuple(s for s in self.recipe.launched_states if s not in self._update_states())

    def _launch(
        self, iteration: int, states: Sequence[str], *, sampling_round: int = 0, round_tokens: int | None = None
    ) -> dict[str, list]:
        """Start each of `states` (in that order) on its workers; state -> the futures of its ranks."""
        launch = self._launchers(iteration, sampling_round, round_tokens)
        return {state: launch[state]() for state in states}

    def _driver(self) -> Driver:
        """What the schedule calls in the trainer, for this attempt's workers."""
        return Driver(
            recipe=self.recipe,
            output_dir=self.output_dir,
            group_size=self.cfg.algorithm.num_responses_per_prompt,
            before_update=self._before_update_states(),
            updates=self._update_states(),
            launch=self._launch,
            draw=self._draw,
            sampler_state=self.sampler.state_dict,
            finish_rollout=self._finish_rollout,
            skip_turns=self._skip_turns,
            before_put=self._wait_for_counters,
            later=lambda fn, *args: self._bookkeeping.later(fn, *args),
        )

    def _actor_rank_states(self) -> set[str]:
        """The states the actor ranks run over the responses, all but the rollout and the updates
        (under LoRA the reference pass too: its spec's group is the actor's, job_recipe)."""
        return {
            spec.name
            for spec in self.recipe.specs
            if spec.group == ACTOR and spec.runs_on == "ranks" and not spec.trains
        }

    def _finish_rollout(self, iteration: int) -> list:
        """Partial rollout: each engine's second round of `iteration`'s generation."""
        return [a.finish_rollout.remote(iteration) for a in self._started().engine_actors]

    def _skip_turns(self, iteration: int, states: list[str]) -> None:
        if self._turns is not None:  # their turns are not taken again
            ray.get(self._turns.skip.remote(iteration, states))

    def _wait_for_counters(self) -> None:
        if self._counters is not None:  # the last iteration's counters, read before this write counts
            self._counters.result()

    def _launchers(self, iteration: int, sampling_round: int = 0, round_tokens: int | None = None) -> dict:
        """State -> a function that starts it on its workers and returns the futures: its spec's
        method on its runners, with the iteration (and the sampling round and the round's token cap
        where the spec takes them)."""

        def launcher(spec: WorkerState):
            extra = (sampling_round, round_tokens) if spec.takes_round else ()
            return lambda: [
                getattr(handle, spec.method).remote(iteration, *extra) for handle in self._started().runners(spec)
            ]

        return {spec.name: launcher(spec) for spec in self.recipe.specs if spec.group is not None}

    def _read_counters(self, dock: TransferDock):
        """The Future of `dock`'s traffic since its last read; the driver's next put waits for it
        (`_wait_for_counters`), so the counters hold exactly this iteration's traffic."""
        self._counters = self._bookkeeping.later(self._dock_traffic, dock)
        return self._counters

    def _dock_traffic(self, dock: TransferDock) -> dict:
        assert self.banks is not None  # the dock is one of this attempt's banks
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
        """After a worker died: what the retry can resume from, as the schedule keeps it."""
        if self.schedule is not None:
            self.schedule.keep_inflight(stop_workers=self._kill_workers)

    def _started(self) -> WorkerGroups:
        """The workers of the running attempt (created by _start, dropped by _stop)."""
        assert self.workers is not None, "the attempt's workers are not running"
        return self.workers

    def _kill_workers(self) -> None:
        if self.workers is not None:
            for handle in self.workers.all():
                ray.kill(handle)
            self.workers = None

    def _save_checkpoint(self, iteration: int) -> None:
        # The records up to this iteration are in metrics.jsonl before the checkpoint commits: a
        # resume keeps only the records up to its checkpoint, and redoes none of these.
        self._bookkeeping.wait()
        staging = ckpt.staging_dir(self.output_dir, iteration)
        workers = self._started()
        ray.get([a.save.remote(str(staging)) for a in workers.actors])
        actor_rng = ray.get([a.get_rng_state.remote() for a in workers.actors])
        torch.save({"actors": actor_rng}, staging / "rng.pt")
        ray.get([c.save.remote(str(staging)) for c in workers.critics])  # rank 0 writes
        # The driver draws no random numbers itself: the sampler's state is the data position, the
        # ranks' torch RNG covers training, and sampling seeds derive from (seed, iteration, index).
        # A run-ahead schedule drew the next iteration's prompts already: it keeps the position before that draw.
        assert self.schedule is not None  # chosen by _start
        state = {"sampler": self.schedule.checkpoint_sampler_state()}
        ckpt.commit(self.output_dir, staging, iteration, state, keep_last=self.cfg.checkpoint.keep_last)
        plot_progress(self.metrics.read(), self.output_dir / PLOT_FILE)


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


def heldout_evaluation(
    cfg: JobConfig, tokenizer, val_files: Sequence[str], *, conversation: ChatRenderer | None = None
) -> Evaluator | None:
    """The evaluator of a job: its held-out prompts (`val_files`: data.val_files, or the generator's
    val split), rendered, tokenized and length-checked exactly like the train prompts, and the job's
    reward terms to score them; None when evaluation is off. `conversation`: an agent job's renderer
    (the held-out prompts describe the tools, as the train prompts do)."""
    if cfg.evaluation.interval == 0:
        return None
    rows = load_rows(val_files, val_columns(cfg.data), field="data.val_files")
    dataset = PromptDataset(
        rows,
        tokenizer=tokenizer,
        spec=cfg.data,
        max_prompt_length=cfg.algorithm.max_prompt_length,
        conversation=conversation,
    )
    positions = range(min(len(dataset), cfg.evaluation.max_prompts or len(dataset)))
    examples = [
        EvalExample(
            prompt=e.prompt,
            ground_truth=e.ground_truth,
            data_source=e.data_source,
            extra_info=e.extra_info,
            row_prompt=row.prompt,
            columns=row.columns,
        )
        for e, row in zip(dataset.examples(positions), dataset.rows(positions))
    ]
    # The driver holds no reward model: held-out responses are scored by the other terms only
    # (config/problems.py refuses evaluation in a job whose only term is `model`).
    scorer = RewardScorer(cfg.reward.model_copy(update={"terms": [t for t in cfg.reward.terms if t.name != "model"]}))

    def score(responses: list[str], scored: list[EvalExample]) -> list[float]:
        return scorer.score(
            responses,
            [e.ground_truth for e in scored],
            [e.data_source for e in scored],
            [e.extra_info for e in scored],
            prompts=[e.prompt if e.row_prompt is None else e.row_prompt for e in scored],
            columns=column_lists([e.columns for e in scored]),
        ).scores.tolist()

    return Evaluator(
        examples,
        score,
        prompt_ids=dataset.prompt_ids(positions),
        tokenizer=tokenizer,
        spec=cfg.evaluation,
        max_response_length=cfg.algorithm.max_response_length,
    )
