"""One attempt of a job: what lives as long as one set of workers, as a context manager.

Entering reserves the devices (the placement plan's Ray placement group), creates the dock banks,
starts the environment servers the job runs itself and the worker groups the recipe's states run
on, seats the turn keeper of a serial phase schedule and, when resuming, has each worker group that
keeps a part of the checkpoint (its spec's `checkpoint`: the actor's optimizer and RNG, the critic's
model and optimizer) restore it; the trainer's checkpoints are saved the same way (`save`). Exiting
stops all of it, in the order that frees the devices first. A worker's death ends the attempt; the
trainer (trainer.py) starts the next one from the last checkpoint, with the same job inputs (inputs.py).

The attempt's workers (`WorkerGroups`) are what a schedule launches stages on: a state's spec
names its group and method, and every rank gets the same `StageCall`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import ray
import torch
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup

from rldock.config import JobConfig
from rldock.contract.placement import PlacementPlan
from rldock.runtime.agent.service.local import JobEnvironmentServers
from rldock.runtime.checkpoint import RANK_STATES_FILE, Checkpoint
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.driver.inputs import JobInputs
from rldock.runtime.driver.rollout_pool import RolloutPool
from rldock.runtime.driver.schedule import num_banks
from rldock.runtime.engines.replica_devices import engine_environments
from rldock.runtime.flow.columns import TOKEN_COLUMNS
from rldock.runtime.flow.states import (
    ACTOR,
    REFERENCE,
    ROLLOUT,
    UPDATE,
    CheckpointState,
    StageCall,
    WorkerContext,
    WorkerGroup,
    WorkerState,
    worker_groups,
)
from rldock.runtime.startup import startup_line, startup_timing
from rldock.runtime.workers import cluster
from rldock.runtime.workers.device_worker import distinct_processes, start_device_seats
from rldock.runtime.workers.phase_keeper import hand_out_turns

logger = logging.getLogger(__name__)


class CheckpointMismatch(RuntimeError):
    """The checkpoint to resume from lacks a file one of the job's worker groups restores from."""


@dataclass
class WorkerGroups:
    """The Ray actors of a job by worker group (rldock.runtime.flow.states): only the groups the
    recipe's states run on exist (DPO has no reward or advantage worker, GRPO and DAPO no advantage
    worker where the reward computes it, only PPO and PF-PPO have critic ranks, only a job with a
    `model` reward term a reward model)."""

    ranks: dict[str, list]  # group name -> its Ray actors by rank
    generation_tp: int = 1  # rollout.tensor_parallel_size: actor ranks per generation replica
    turns: ActorHandle | None = None  # the TurnKeeper of a serial phase schedule (runtime/workers/phase_keeper.py)
    pool: RolloutPool | None = None  # rollout.pool's engines, which generate beside the engine ranks (rollout_pool.py)

    @property
    def actors(self) -> list:
        return self.ranks.get(ACTOR.name, [])

    @property
    def references(self) -> list:
        return self.ranks.get(REFERENCE.name, [])

    @property
    def engine_actors(self) -> list:
        """The actors holding a rollout engine: each generation replica's first rank."""
        return self.actors[:: self.generation_tp]

    def runners(self, spec: WorkerState) -> list:
        """The Ray actors that run `spec`'s state: every rank of its group, or the engine ranks."""
        assert spec.group is not None  # a state without a group runs on the driver, not on runners
        if spec.runs_on == "pool":
            return []  # the rollout pool's engines, which `launch` adds
        handles = self.ranks[spec.group.name]
        return handles[:: self.generation_tp] if spec.runs_on == "engines" else handles

    def launch(self, call: StageCall, specs: Sequence[WorkerState]) -> dict[str, list]:
        """Start each state of `specs` (in that order): its spec's method with `call` on every
        runner; state -> the futures of its ranks."""
        launched, pool = {}, self.pool
        for spec in specs:
            pooled = pool is not None and spec.name == ROLLOUT.name
            if pool is not None and pooled:  # rank 0 publishes before its own rollout, which the pool need not wait for
                pool.publish()
            launched[spec.name] = [getattr(h, spec.method).remote(call) for h in self.runners(spec)]
            if pool is not None and pooled:
                launched[spec.name] += pool.launch_rollout(call)
            elif pool is not None and spec.name == UPDATE.name:
                pool.update_launched()
        return launched

    def recover(self, ref, error: Exception):
        """The future of a call that replaces the one behind `ref`, whose worker died, or None when that
        death fails the attempt (only a rollout pool's engine is replaced: RolloutPool.recover)."""
        return None if self.pool is None else self.pool.recover(ref, error)

    def skip_turns(self, iteration: int, states: list[str]) -> None:
        """A resumed iteration's finished stages give up their turns (serial phase schedule)."""
        if self.turns is not None:
            ray.get(self.turns.skip.remote(iteration, states))

    def timeline(self, iteration: int) -> list[dict] | None:
        """Each shared device's phases of `iteration`, start and end (s); None without turns."""
        return None if self.turns is None else ray.get(self.turns.timeline.remote(iteration))

    def all(self, *, starting: bool = True) -> list:
        """The job's worker processes (Ray actors), each once: a device worker holds several ranks; a rollout pool's
        engines still starting too, unless `starting` is False."""
        pool = [] if self.pool is None else self.pool.processes(starting=starting)
        return [*distinct_processes([handle for handles in self.ranks.values() for handle in handles]), *pool]

    def kill(self) -> None:
        """Kill every worker process and the turn keeper, and return once they have ended."""
        if self.pool is not None:  # no engine started while they go
            self.pool.close()
        cluster.end_actors([*self.all(), *([self.turns] if self.turns is not None else [])])
        self.ranks, self.turns, self.pool = {}, None, None


class Attempt:
    """The devices, dock banks, environment servers and workers of one attempt (see the module)."""

    def __init__(self, cfg: JobConfig, inputs: JobInputs, *, output_dir: Path, resume_from: Checkpoint | None):
        self.cfg, self.inputs, self.output_dir, self.resume_from = cfg, inputs, output_dir, resume_from
        self.plan: PlacementPlan | None = None  # the placement plan (cluster.job_placement) of the devices
        self.placement: PlacementGroup | None = None  # the Ray placement group reserved for it
        self.banks: DockBanks | None = None
        self.environment_servers: JobEnvironmentServers | None = None
        self.workers: WorkerGroups | None = None

    def __enter__(self) -> Attempt:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def policy_version(self) -> int:
        """Weight updates behind the policy the workers start from (the checkpoint's iteration)."""
        return 0 if self.resume_from is None else self.resume_from.iteration

    def _start(self) -> None:
        cfg, recipe = self.cfg, self.inputs.recipe
        if self.resume_from is not None:  # before any device is reserved or worker started
            self._check_resumable(self.resume_from)
        # The devices before the dock: after a lost worker pod, Ray has the replacement node only
        # once this reservation is ready, and the dock's warehouses go on the worker nodes alive
        # when it starts (the head alone would get them).
        self.plan = plan = cluster.job_placement(cfg, recipe)
        self.placement = cluster.reserve(plan)
        # Two banks when the next iteration's samples are put while this one's still train.
        self.banks = DockBanks(
            [
                TransferDock.create(
                    cfg.dock,
                    states={s: list(c) for s, c in recipe.consumes.items()},
                    num_samples=cfg.num_samples_per_iteration,
                    group_size=cfg.rows_per_group,
                    token_columns=TOKEN_COLUMNS,
                    colocate_controllers=cfg.ablations.colocate_controllers,
                    shared_memory=cfg.ablations.shared_memory,
                    # the staleness bound (dock.max_staleness) guards what trains
                    bounded_states=[recipe.update_state],
                )
                for _ in range(num_banks(cfg))
            ]
        )
        # Before the workers, whose rollout engines open sessions on them.
        self.environment_servers = JobEnvironmentServers(cfg, log_dir=self.output_dir / "environments")
        environment_urls = self.environment_servers.start()
        policy_dir, adapter_dir = self.inputs.reference_dir, None
        if self.resume_from is not None:
            policy_dir = self.resume_from.policy_dir
            if cfg.training.lora is not None:  # the actors load the base model and the trained adapters on top
                policy_dir, adapter_dir = self.inputs.reference_dir, str(self.resume_from.adapter_dir)
        context = WorkerContext(
            cfg=cfg,
            recipe=recipe,
            banks=self.banks,
            policy_dir=str(policy_dir),
            reference_dir=str(self.inputs.reference_dir),
            adapter_dir=adapter_dir,
            policy_version=self.policy_version,
            environment_urls=environment_urls,
        )
        self.workers = self.create_workers(context)
        if self.resume_from is not None:
            self.restore(self.resume_from)

    def create_workers(self, context: WorkerContext) -> WorkerGroups:
        """The workers of every worker group the recipe's states run on (their specs,
        rldock.runtime.flow.states): the device groups' ranks on their seats of the placement plan, the
        seats of one device in one process (workers/device_worker.py), the others one Ray actor per
        rank outside it; then each collective group joins its own process group."""
        cfg, plan, placement = self.cfg, self.plan, self.placement
        assert plan is not None and placement is not None  # reserved by _start
        specs = worker_groups(self.inputs.recipe.specs)
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
        # The pool's engines start while the trainer's ranks form their groups (they need none).
        pool = RolloutPool(cfg, context, num_actor_ranks=len(actors), publisher=actors[0]) if cfg.rollout.pool else None
        try:
            # Each engine rank sees its replica's devices before its engine starts (replica_devices).
            engine_envs = engine_environments(
                ray.get([a.device_seat.remote() for a in actors]), generation_tp=groups.generation_tp
            )
            for name, spec in specs.items():
                handles = ranks[name]
                if spec.joins_group(cfg) and handles:  # the group's own DDP group (the actor's also sets up engines)
                    rendezvous = ray.get(handles[0].pick_rendezvous.remote())
                    ray.get(
                        [
                            h.join_group.remote(rendezvous, *((engine_envs.get(r),) if name == ACTOR.name else ()))
                            for r, h in enumerate(handles)
                        ]
                    )
            groups.turns = hand_out_turns(cfg, plan, self.inputs.recipe, groups)  # fresh with every new set of workers
            if pool is not None:
                pool.wait_up()
                groups.pool = pool
        except BaseException:
            if pool is not None and groups.pool is None:  # outside the placement group: nothing else ends them
                pool.kill()
            raise
        return groups

    def _checkpointed(self) -> list[tuple[WorkerGroup, CheckpointState]]:
        """The recipe's worker groups that keep a part of the checkpoint, in the recipe's order (the actor's
        first), each with what it keeps (its spec's `checkpoint`)."""
        groups = worker_groups(self.inputs.recipe.specs).values()
        return [(group, group.checkpoint) for group in groups if group.checkpoint is not None]

    def save(self, staging: Path) -> None:
        """Every worker group's part of the checkpoint into `staging` (its folder until it commits): each
        group's ranks save at once, group after group; the states they return are kept in one file, by
        the group's key (rng.pt: {"actors": the actor ranks' torch RNG states})."""
        workers, rank_states = self.started(), {}
        for group, kept in self._checkpointed():
            states = ray.get([handle.save.remote(str(staging)) for handle in workers.ranks[group.name]])
            if kept.rank_states is not None:
                rank_states[kept.rank_states] = states
        torch.save(rank_states, staging / RANK_STATES_FILE)

    def _check_resumable(self, checkpoint: Checkpoint) -> None:
        """CheckpointMismatch when `checkpoint` lacks a file a worker group of this job restores from."""
        for group, kept in self._checkpointed():
            missing = [name for name in kept.files if not (checkpoint.path / name).exists()]
            if missing:
                raise CheckpointMismatch(
                    f"{checkpoint.path} holds no {', '.join(missing)}, which the job's {group.name} workers "
                    "resume from: was it written by a job of another algorithm? Resume it with that job's "
                    "config, or start this job in another --output"
                )

    def restore(self, checkpoint: Checkpoint) -> None:
        """Every worker group's part of `checkpoint` into the workers just created, group after group (the
        policy itself the actor ranks loaded as they started: WorkerContext.policy_dir)."""
        workers, checkpointed = self.started(), self._checkpointed()
        rank_states = torch.load(checkpoint.path / RANK_STATES_FILE)
        for group, kept in checkpointed:
            states = rank_states[kept.rank_states] if kept.rank_states is not None else None
            handles = workers.ranks[group.name]
            ray.get(
                [
                    handle.restore.remote(str(checkpoint.path), None if states is None else states[rank])
                    for rank, handle in enumerate(handles)
                ]
            )

    def processes(self) -> list:
        """Every Ray actor the attempt started and that is up, each once: the workers, the turn keeper, the docks'
        actors (not a rollout pool engine still starting, whose start-up the first iteration does not wait for)."""
        workers = self.started()
        assert self.banks is not None  # created before the workers
        turns = [workers.turns] if workers.turns is not None else []
        return [*workers.all(starting=False), *turns, *(actor for dock in self.banks.docks for actor in dock.actors())]

    def startup(self) -> dict | None:
        """timing/startup (rldock.runtime.startup), read now, before the first iteration: the driver's
        and every process's start-up CPU, and the wall time since the driver's process started;
        logged by kind, and per process at debug level. None on every attempt after the run's first."""
        clock = self.inputs.startup_clock
        if not clock.read_once():
            return None
        processes = [clock.driver_startup(), *ray.get([p.startup.remote() for p in self.processes()])]
        for process in processes:
            logger.debug("start-up of %s", process)
        timing = startup_timing(processes, wall=clock.wall_since_start())
        logger.info("start-up: %s", startup_line(timing))
        return timing

    def started(self) -> WorkerGroups:
        """The attempt's workers (created on entry, dropped on exit)."""
        assert self.workers is not None, "the attempt's workers are not running"
        return self.workers

    def kill_workers(self) -> None:
        """Stop the workers now (before the dock of a failed iteration is read for its retry)."""
        if self.workers is not None:
            self.workers.kill()

    def stop(self) -> None:
        """Stop everything the attempt started; safe to call on a partly started attempt."""
        self.kill_workers()
        if self.placement is not None:  # after the workers: their devices go back to the cluster
            cluster.release(self.placement)
        if self.banks is not None:
            self.banks.shutdown()
            cluster.wait_ended([actor for dock in self.banks.docks for actor in dock.actors()])
        if self.environment_servers is not None:  # after the workers: no session is left to end
            self.environment_servers.stop()
        self.workers, self.banks, self.environment_servers = None, None, None
        self.placement = self.plan = None
