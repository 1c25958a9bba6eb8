"""The GRPO driver: prepares the initial policy, starts the worker groups, and runs iterations
whose every sample moves through the transfer dock, with checkpoints, metrics and progress.

One iteration, as data moves (see docs/architecture.md):
  driver puts G prompts (each repeated N times) -> rollout (actor ranks, vLLM) -> old logprobs
  (actor ranks) | reference logprobs | rule reward -> advantages -> update (actor ranks, DDP)
  -> new weights pushed into each rank's engine in memory.
All stages are launched at once; the dock's controllers hand a sample to a stage only when its
input columns are ready, which is what orders them.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.progress import format_progress
from rldock.runtime import checkpoint as ckpt
from rldock.runtime import cluster
from rldock.runtime.dataflow import CONSUMES, TOKEN_COLUMNS
from rldock.runtime.dock import TransferDock
from rldock.runtime.metrics import PLOT_FILE, MetricsLog, dock_traffic, plot_progress, tokens_per_s_per_device
from rldock.runtime.models.loading import encode_answers, encode_prompts, load_tokenizer
from rldock.runtime.models.tiny import build_tiny_model
from rldock.runtime.tasks import PromptSampler, make_task
from rldock.runtime.warmup import run_warmup
from rldock.runtime.workers.actor import ActorWorker
from rldock.runtime.workers.advantage import AdvantageWorker
from rldock.runtime.workers.reference import ReferenceWorker
from rldock.runtime.workers.reward import RewardWorker

logger = logging.getLogger(__name__)

WARMUP_DIR = "warmup"


class OutputDirInUse(RuntimeError):
    pass


def prepare_initial_policy(cfg: JobConfig, output_dir: Path, task) -> Path:
    """Model dir the RL phase starts from (and the reference policy): the base model, after the
    supervised warm-up when one is configured. Both steps are skipped when their output exists."""
    base = Path(cfg.model.path).expanduser()
    if cfg.model.builder and not (base / "config.json").is_file():
        logger.info("building tiny model %s at %s", cfg.model.builder, base)
        _write_atomically(base, lambda tmp: build_tiny_model(tmp, texts=task.corpus(), seed=cfg.seed))
    if cfg.warmup.steps == 0:
        return base
    warm = output_dir / WARMUP_DIR
    if not (warm / "config.json").is_file():
        logger.info("supervised warm-up: %d steps", cfg.warmup.steps)
        _write_atomically(warm, lambda tmp: run_warmup(base, tmp, task=task, spec=cfg.warmup, seed=cfg.seed))
    return warm


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
    actors: list
    references: list
    reward: object
    advantage: object

    def all(self) -> list:
        return [*self.actors, *self.references, self.reward, self.advantage]


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
        self.task = make_task(cfg.task, seed=cfg.seed)
        self.sampler = PromptSampler(len(self.task), seed=cfg.seed)
        self.reference_dir = prepare_initial_policy(cfg, self.output_dir, self.task)
        self.tokenizer = load_tokenizer(self.reference_dir)
        self.resume_from = ckpt.latest_checkpoint(self.output_dir) if resume else None
        self.dock: TransferDock | None = None
        self.workers: WorkerGroups | None = None
        self._last_dock_stats: dict | None = None

    def _check_output_dir(self, resume: bool) -> None:
        if not resume and (self.metrics.path.exists() or ckpt.latest_checkpoint(self.output_dir)):
            raise OutputDirInUse(
                f"{self.output_dir} already holds a run; pass --resume to continue it or choose "
                "another --output")

    # --- lifecycle ----------------------------------------------------------------------------

    def run(self) -> list[dict]:
        if self.resume_from is not None and self.resume_from.iteration >= self.cfg.iterations:
            logger.info("%s already finished all %d iterations", self.output_dir, self.cfg.iterations)
            return self.metrics.read()
        cluster.connect(self.cfg)
        for attempt in range(self.max_restarts + 1):
            try:
                start_iteration = self._start()
                self._loop(start_iteration)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as error:
                # A worker process died (killed, out of memory, node lost): restart every worker
                # and the dock from the last checkpoint. Errors raised by our own code are not
                # retried: they would fail the same way again.
                if attempt == self.max_restarts:
                    raise
                logger.warning("a worker died (%s); restart %d of %d from the last checkpoint",
                               error, attempt + 1, self.max_restarts)
                self.resume_from = ckpt.latest_checkpoint(self.output_dir)
            finally:
                self._stop()
        records = self.metrics.read()
        plot_progress(records, self.output_dir / PLOT_FILE)
        return records

    def _start(self) -> int:
        cfg = self.cfg
        algo = cfg.algorithm
        self.dock = TransferDock.create(cfg.dock, states={s: list(c) for s, c in CONSUMES.items()},
                                        num_samples=cfg.num_samples_per_iteration,
                                        group_size=algo.num_responses_per_prompt,
                                        token_columns=TOKEN_COLUMNS)
        policy_dir = self.reference_dir
        start_iteration = 1
        if self.resume_from is not None:
            state = self.resume_from.state()
            policy_dir = self.resume_from.policy_dir
            start_iteration = self.resume_from.iteration + 1
            self.sampler.load_state_dict(state["sampler"])
            logger.info("resuming after iteration %d from %s", self.resume_from.iteration, self.resume_from.path)
        # Records after the last checkpoint belong to iterations that will be redone.
        self.metrics.truncate_after(start_iteration - 1)
        self.workers = self._create_workers(str(policy_dir))
        if self.resume_from is not None:
            rng = torch.load(self.resume_from.path / "rng.pt")
            ray.get([a.load_optimizer.remote(str(self.resume_from.optimizer_file)) for a in self.workers.actors])
            ray.get([a.set_rng_state.remote(rng["actors"][i]) for i, a in enumerate(self.workers.actors)])
        return start_iteration

    def _create_workers(self, policy_dir: str) -> WorkerGroups:
        cfg, dock = self.cfg, self.dock
        dp = cfg.training.data_parallel_size
        share = cluster.device_share(cfg)
        actors = [cluster.remote(ActorWorker, num_cpus=1, resources=share).remote(
            cfg, rank=r, world_size=dp, policy_dir=policy_dir, dock=dock) for r in range(dp)]
        references = [cluster.remote(ReferenceWorker, num_cpus=1, resources=share).remote(
            cfg, rank=r, reference_dir=str(self.reference_dir), dock=dock) for r in range(dp)]
        reward = cluster.remote(RewardWorker, num_cpus=0).remote(
            cfg, tokenizer_dir=str(self.reference_dir), dock=dock)
        advantage = cluster.remote(AdvantageWorker, num_cpus=0).remote(cfg, dock=dock)
        groups = WorkerGroups(actors, references, reward, advantage)
        rendezvous = ray.get(actors[0].pick_rendezvous.remote())
        ray.get([a.join_group.remote(rendezvous) for a in actors])
        return groups

    def _stop(self) -> None:
        if self.workers is not None:
            for handle in self.workers.all():
                ray.kill(handle)
        if self.dock is not None:
            self.dock.shutdown()
        self.workers, self.dock, self._last_dock_stats = None, None, None

    # --- iterations ---------------------------------------------------------------------------

    def _loop(self, start_iteration: int) -> None:
        total = self.cfg.iterations
        progress = _progress_bar(total, start_iteration - 1, enabled=self.show_progress)
        try:
            for iteration in range(start_iteration, total + 1):
                record = self._run_iteration(iteration)
                self.metrics.append(record)
                if iteration % self.cfg.checkpoint.interval == 0 or iteration == total:
                    self._save_checkpoint(iteration)
                progress.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record['kl']:.4f}",
                                     tps=f"{record['tokens_per_s_per_device']:.0f}", refresh=False)
                progress.update(1)
                if not self.show_progress:  # the bar is for people, the lines for the operator
                    self._report_progress(record)
        finally:
            progress.close()

    def _report_progress(self, record: dict) -> None:
        """One machine-readable line per iteration on stdout; the operator reads it from the Ray
        job log (it runs jobs with --no-progress)."""
        latest = ckpt.latest_checkpoint(self.output_dir)
        headline = {**_headline(record), "iteration": record["iteration"], "iterations": self.cfg.iterations,
                    "checkpoint": latest.iteration if latest else None}
        print(format_progress(headline), flush=True)

    def _run_iteration(self, iteration: int) -> dict:
        cfg, algo, w = self.cfg, self.cfg.algorithm, self.workers
        started = time.perf_counter()
        self.dock.reset()
        put_seconds, prompt_lengths = self._put_prompts()
        futures = {
            "rollout": [a.generate.remote(iteration) for a in w.actors],
            "actor_inference": [a.compute_old_logprobs.remote(iteration) for a in w.actors],
            "reference": [r.compute_ref_logprobs.remote(iteration) for r in w.references],
            "reward": [w.reward.compute_rewards.remote(iteration)],
            "advantage": [w.advantage.compute_advantages.remote(iteration)],
            "update": [a.update.remote(iteration) for a in w.actors],
        }
        results = _gather_failing_fast(futures)
        seconds = time.perf_counter() - started

        rewards = [x for r in results["reward"] for x in r["rewards"]]
        response_lengths = [x for r in results["rollout"] for x in r["response_lengths"]]
        updates = results["update"]
        prompt_length = statistics.fmean(prompt_lengths)
        response_length = statistics.fmean(response_lengths)
        # A stage's time is its slowest rank's busy time (moving data + computing); waiting for
        # upstream stages is excluded, since all stages run at once and overlap.
        timing = {stage: max(r["dispatch_s"] + r["compute_s"] for r in rs) for stage, rs in results.items()}
        # dispatch: all time spent moving samples through the dock, summed over every worker.
        timing["dispatch"] = put_seconds + sum(r["dispatch_s"] for rs in results.values() for r in rs)
        timing["iteration"] = seconds
        return {
            "iteration": iteration,
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "response_length_mean": response_length,
            "prompt_length_mean": prompt_length,
            "kl": statistics.fmean(u["kl"] for u in updates),
            "loss": statistics.fmean(u["loss"] for u in updates),
            "policy_loss": statistics.fmean(u["policy_loss"] for u in updates),
            "clip_fraction": statistics.fmean(u["clip_fraction"] for u in updates),
            "grad_norm": statistics.fmean(u["grad_norm"] for u in updates),
            "tokens_per_s_per_device": tokens_per_s_per_device(
                num_prompts=algo.num_prompts_per_iteration, num_responses=algo.num_responses_per_prompt,
                prompt_length=prompt_length, response_length=response_length,
                num_devices=cfg.training.data_parallel_size, seconds=seconds),
            "timing": timing,
            "dock": self._dock_traffic(),
        }

    def _dock_traffic(self) -> dict:
        stats = self.dock.stats()
        traffic = dock_traffic(self._last_dock_stats, stats)
        self._last_dock_stats = stats
        return traffic

    def _put_prompts(self) -> tuple[float, list[int]]:
        """Draw G prompts and put each N times (one row per sample) into the dock."""
        algo = self.cfg.algorithm
        started = time.perf_counter()
        items = [self.task[i] for i in self.sampler.next_batch(algo.num_prompts_per_iteration)]
        prompt_ids, prompt_mask = encode_prompts(self.tokenizer, [p for p, _ in items], algo.max_prompt_length)
        answer_ids, answer_mask = encode_answers(self.tokenizer, [a for _, a in items], algo.max_response_length)
        n = algo.num_responses_per_prompt
        batch = TensorDict({
            "prompt_ids": prompt_ids.repeat_interleave(n, dim=0),  # (G*N, PL)
            "prompt_mask": prompt_mask.repeat_interleave(n, dim=0),
            "answer_ids": answer_ids.repeat_interleave(n, dim=0),  # (G*N, A)
            "answer_mask": answer_mask.repeat_interleave(n, dim=0),
        }, batch_size=[len(items) * n])
        self.dock.put(torch.arange(len(items) * n), batch)
        return time.perf_counter() - started, prompt_mask.sum(dim=1).tolist()

    def _save_checkpoint(self, iteration: int) -> None:
        staging = ckpt.staging_dir(self.output_dir, iteration)
        ray.get([a.save.remote(str(staging)) for a in self.workers.actors])
        actor_rng = ray.get([a.get_rng_state.remote() for a in self.workers.actors])
        torch.save({"actors": actor_rng}, staging / "rng.pt")
        # The driver draws no random numbers itself: the sampler's state is the data position, the
        # ranks' torch RNG covers training, and sampling seeds derive from (seed, iteration, index).
        state = {"sampler": self.sampler.state_dict()}
        ckpt.commit(self.output_dir, staging, iteration, state, keep_last=self.cfg.checkpoint.keep_last)
        plot_progress(self.metrics.read(), self.output_dir / PLOT_FILE)


def _gather_failing_fast(futures: dict[str, list]) -> dict[str, list[dict]]:
    """ray.get of every stage, raising the first worker error at once instead of waiting for the
    other stages to time out on data that will never come."""
    stage_of = {ref: stage for stage, refs in futures.items() for ref in refs}
    pending = list(stage_of)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)  # raises the worker's exception, naming the actor and stage
    return {stage: ray.get(refs) for stage, refs in futures.items()}


def _headline(record: dict) -> dict:
    keys = ("reward_mean", "kl", "loss", "response_length_mean", "tokens_per_s_per_device")
    return {k: round(record[k], 4) for k in keys}


def _progress_bar(total: int, initial: int, *, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="GRPO", unit="it", disable=not enabled, dynamic_ncols=True)
