"""The rollout pool as the driver keeps it (rollout.pool): its engines (workers/pool_engine.py), the policy versions
handed to them, and an engine's death.

- Start: `rollout.pool.replicas` engines (in an RLJob, as many as its pool group's devices allow now, at least one),
  each a Ray actor asking for one device outside the job's placement group (the pool's devices are apart from the
  trainer's), waited for like the other workers.
- Weights: once an update has been launched, the next rollout's launch first queues actor rank 0's
  `published_weights` (before rank 0's own rollout, which the pool's engines then need not wait for) and hands
  its answer to every engine's `load_weights`. Ray resolves it on each engine from the object store (the
  weights never pass through the driver) and runs one actor's calls in the order they were submitted, so rank 0
  answers after that update and each engine loads before it generates: a pool engine samples with the version
  the actor ranks' engines sample with, in the sync and the run-ahead schedule alike.
- A rollout: every engine that is up gets the call and takes whole prompt groups from the dock while any are left,
  beside the actor ranks' engines, in requests of the iteration's samples over the engines up then
  (engines/rank_engine.py `engine_batch_size`).
- A death (`recover`, which the stage gather asks): the engine is dropped, what it took and did not finish goes back
  to the dock (TransferDock.hand_back) and a surviving pool engine is asked to generate again; with none left, the
  driver waits (at most PLACEMENT_TIMEOUT_S) for a new one on a device that frees or joins, else the death fails
  the attempt as any worker's does.
- Growth (`watch`): every WATCH_INTERVAL_S, and before each rollout, an engine starts for each device the pool should
  have and has none on (a free one on a local Ray; in an RLJob, one of the pool's worker group, which the operator
  scales): a replacement, or an engine on a pod the pool grew by. It generates once it is up, admitted by the next
  rollout after loading the newest version. The watch runs in a thread of its own, so an engine starts as soon as
  its device appears, not at an iteration's pace; the driver's other calls and it share one lock.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle

from rldock.config import JobConfig
from rldock.runtime.engines.rank_engine import engine_batch_size
from rldock.runtime.flow.states import ROLLOUT, StageCall, WorkerContext
from rldock.runtime.workers import cluster
from rldock.runtime.workers.pool_engine import PoolEngineWorker, pool_rank

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 2.0  # how often the pool looks for devices it should start engines on


@dataclass(frozen=True)
class _Launched:
    """A rollout call on a pool engine: which engine, which call (to run again on another after a death)."""

    index: int
    call: StageCall


class RolloutPool:
    """The pool's engines of one attempt (module docstring)."""

    def __init__(self, cfg: JobConfig, context: WorkerContext, *, num_actor_ranks: int, publisher: ActorHandle):
        """`publisher`: actor rank 0, whose `published_weights` answers with the version its last update pushed."""
        assert cfg.rollout.pool is not None, "a job without rollout.pool has no pool"
        self.cfg, self.context, self.num_actor_ranks, self.publisher = cfg, context, num_actor_ranks, publisher
        self.replicas = cfg.rollout.pool.replicas
        # In an RLJob's RayCluster the pool is a worker group of its own, which the operator scales
        # (rldock.contract.pool_nodes): its engines go there, and its size is the devices there.
        self.on_pool_nodes = cluster.pool_nodes_managed()
        self.engines: dict[int, ActorHandle] = {}  # index -> an engine that is up
        self.starting: dict[int, tuple[ActorHandle, ray.ObjectRef]] = {}  # index -> (engine, its readiness)
        self.lost = 0  # engines that died in this attempt
        self._next_index = 0
        # An update was launched since the engines were last given weights; or, at a resumed LoRA job's start,
        # they started from the base model's files and the policy is the base with the trained adapters.
        self._update_launched = context.adapter_dir is not None
        self._newest: ray.ObjectRef | None = None  # the newest version published to them (a PublishedWeights)
        # The version the launched updates make (the files' at the start); what the engines must hold after the
        # newest publish: an engine whose load failed refuses to generate rather than sample with older weights.
        self._version = context.policy_version
        self._published_version = context.policy_version
        self._launched: dict[ray.ObjectRef, _Launched] = {}
        # The engines of the iteration's first sampling round, by position: DAPO's later rounds keep the positions
        # (driver/feed.py merges each position's results over the rounds), a dead engine's taken by a survivor.
        self._positions: list[int] = []
        self._lock = threading.RLock()  # the watch's thread and the driver's calls
        self._stop_watching = threading.Event()
        self._watch: threading.Thread | None = None
        # In an RLJob, as many as its group's devices now (the operator may have scaled it since the config was
        # written), at least one (its nodes may still be joining); the watch starts the rest as they join.
        first = max(1, min(self.replicas, self.target())) if self.on_pool_nodes else self.replicas
        for _ in range(first):
            self._start_engine()

    def wait_up(self, *, timeout_s: float = cluster.PLACEMENT_TIMEOUT_S) -> None:
        """Once the engines started with the pool are up (as every worker, before the first iteration); a
        PlacementTimeout naming the fields when the cluster has no devices for them within `timeout_s`."""
        ready = [ready for _, ready in self.starting.values()]
        up, _ = ray.wait(ready, num_returns=len(ready), timeout=timeout_s)
        if len(up) < len(ready):
            accelerator = self.cfg.resources.accelerator_resource
            raise cluster.PlacementTimeout(
                f"{len(ready) - len(up)} of the rollout pool's {len(ready)} engines were not up within {timeout_s:.0f} "
                f"s: each asks Ray for one {accelerator} of its own, beside the trainer's, and the cluster has "
                f"{cluster.free_devices(accelerator):g} free now (an engine's own start counts too). Add devices, or "
                "lower rollout.pool.replicas"
            )
        ray.get(ready)  # an engine that failed to start fails the attempt here, as any worker does
        with self._lock:
            self._admit_started()
        self._watch = threading.Thread(target=self._watching, name="rollout-pool-watch", daemon=True)
        self._watch.start()

    def _watching(self) -> None:
        while not self._stop_watching.wait(WATCH_INTERVAL_S):
            try:
                with self._lock:
                    if self._stop_watching.is_set():  # closed while it waited for the lock: start nothing
                        return
                    self._replace_lost()
            except Exception:  # a cluster call that failed: the next look, or the next rollout, tries again
                logger.exception("the rollout pool could not look for new devices")

    def close(self) -> None:
        """Stop watching for devices (before the engines are ended): once the lock is had, the watch starts no
        engine any more."""
        self._stop_watching.set()
        with self._lock:
            pass

    # --- what the attempt's workers ask --------------------------------------------------------

    def processes(self, *, starting: bool = True) -> list[ActorHandle]:
        """Every engine of the pool that is up, and those still starting unless `starting` is False."""
        with self._lock:
            return [*self.engines.values(), *(handle for handle, _ in self.starting.values() if starting)]

    def update_launched(self) -> None:
        """An update was launched: the next rollout's engines load the version it makes."""
        self._update_launched = True
        self._version += 1

    def publish(self) -> None:
        """Before a rollout is launched on the actor ranks: when an update was launched since the engines were
        last given weights, queue actor rank 0's answer with the version it makes (after that update, before
        rank 0's own rollout, which the pool's engines then need not wait for) and each engine's load of it."""
        if not self._update_launched:
            return
        self._update_launched = False
        with self._lock:
            self._newest = self.publisher.published_weights.remote()
            self._published_version = self._version
            for engine in self.engines.values():
                engine.load_weights.remote(self._newest)

    def launch_rollout(self, call: StageCall) -> list[ray.ObjectRef]:
        """The rollout `call` on every engine that is up, after the newest weights (`publish`, called first);
        the futures of their results."""
        with self._lock:
            if call.sampling_round == 0:  # engines join and leave the positions between iterations only
                self._admit_started()
                self._replace_lost()
                self._positions = sorted(self.engines)
            # two iterations are in flight at most (the run-ahead schedule): older calls were gathered
            self._launched = {r: ran for r, ran in self._launched.items() if ran.call.iteration >= call.iteration - 1}
            if not self.engines:
                return []
            return [
                self._generate(index if index in self.engines else min(self.engines), call, self._published_version)
                for index in self._positions
            ]

    def _batch_size(self) -> int:
        """Samples per dock request of a pool engine, over the engines of this iteration's positions."""
        return engine_batch_size(self.cfg, num_actor_ranks=self.num_actor_ranks, pool_engines=len(self._positions))

    def recover(self, ref: ray.ObjectRef, error: Exception) -> ray.ObjectRef | None:
        """After the call behind `ref` found its worker dead: when it was a pool engine's rollout, hand its
        unfinished groups back to the dock and return the future of the same call on a surviving engine
        (None: not a pool engine's call, or no engine is left, and the death fails the attempt)."""
        with self._lock:
            return self._recover(ref, error)

    def _recover(self, ref: ray.ObjectRef, error: Exception) -> ray.ObjectRef | None:
        launched = self._launched.pop(ref, None)
        if launched is None:
            return None
        dead = self.engines.pop(launched.index, None)
        if dead is not None:
            self.lost += 1
            ray.kill(dead)  # whatever is left of it
        bank = self.context.banks.bank(launched.call.iteration)  # type: ignore[attr-defined]
        outputs = self.context.recipe.produces.get(ROLLOUT.name, ())  # type: ignore[attr-defined]
        back = bank.hand_back(
            ROLLOUT.name, pool_rank(launched.index, num_actor_ranks=self.num_actor_ranks), outputs=outputs
        )
        logger.warning(
            "rollout pool engine %d died (%s); %d of its samples of iteration %d go back to the dock; %d engines left",
            launched.index,
            type(error).__name__,
            back,
            launched.call.iteration,
            len(self.engines),
        )
        if not self.engines and not self._wait_for_an_engine():
            return None
        # On a survivor, after what is queued there: in the run-ahead schedule a newer version's load may be, and the
        # groups are then sampled (and tagged) by that version, one newer than the dead engine's.
        return self._generate(min(self.engines), launched.call, None)

    def _wait_for_an_engine(self, timeout_s: float = cluster.PLACEMENT_TIMEOUT_S) -> bool:
        """The last engine is lost: start one where there is a device (its pod's again, KubeRay's new pod) and wait
        for it to be up and loaded with the newest version, up to `timeout_s`; whether one is. None can start (no
        device, or it failed) within that time: the death fails the attempt as any worker's does."""
        logger.warning("the rollout pool lost its last engine; waiting up to %.0f s for another", timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._replace_lost()
            self._admit_started()
            if self.engines:
                return True
            ready = [ready for _, ready in self.starting.values()]
            if ready:
                ray.wait(ready, num_returns=1, timeout=min(WATCH_INTERVAL_S, max(deadline - time.monotonic(), 0)))
            else:
                time.sleep(WATCH_INTERVAL_S)
        return False

    # --- the engines ---------------------------------------------------------------------------

    def _generate(self, index: int, call: StageCall, version: int | None) -> ray.ObjectRef:
        ref: ray.ObjectRef = self.engines[index].generate.remote(call, version=version, batch_size=self._batch_size())
        self._launched[ref] = _Launched(index, call)
        return ref

    def kill(self) -> None:
        """End every engine of the pool (an attempt that failed before its workers were handed out)."""
        self.close()
        cluster.end_actors(self.processes())

    def _start_engine(self) -> None:
        index, self._next_index = self._next_index, self._next_index + 1
        context = self.context
        engine = cluster.on_a_device_of_its_own(
            PoolEngineWorker, accelerator=self.cfg.resources.accelerator_resource, on_pool_nodes=self.on_pool_nodes
        ).remote(
            self.cfg,
            recipe=context.recipe,
            index=index,
            num_actor_ranks=self.num_actor_ranks,
            policy_dir=context.policy_dir,
            banks=context.banks,
            policy_version=context.policy_version,
            environment_urls=context.environment_urls,
        )
        ready = engine.__ray_ready__.remote()
        self.starting[index] = (engine, ready)
        # said as it happens (the next rollout admits it), so a user sees a new engine come up
        ready.future().add_done_callback(lambda done: _said_up(index, done))

    def _admit_started(self) -> None:
        """Engines that came up join the pool, the newest version loaded first; one that failed to start is dropped."""
        for index, (engine, ready) in list(self.starting.items()):
            if not ray.wait([ready], timeout=0)[0]:
                continue
            del self.starting[index]
            try:
                ray.get(ready)
            except ray.exceptions.RayError as error:
                logger.warning("rollout pool engine %d did not start: %s", index, error)
                continue
            if self._newest is not None:
                engine.load_weights.remote(self._newest)
            self.engines[index] = engine

    def target(self) -> int:
        """The engines the pool should have: the devices of its worker group in an RLJob's RayCluster (the
        operator scales it), else rollout.pool.replicas."""
        if self.on_pool_nodes:
            return cluster.pool_node_devices(self.cfg.resources.accelerator_resource)
        return self.replicas

    def _replace_lost(self) -> None:
        """Start engines up to `target` while there is a device for each: in the pool's worker group, a device
        it holds (a new pod's, a dead engine's); elsewhere, a free device of the cluster's."""
        accelerator, target = self.cfg.resources.accelerator_resource, self.target()
        while len(self.engines) + len(self.starting) < target and (
            self.on_pool_nodes or cluster.free_devices(accelerator) >= 1
        ):
            self._start_engine()
            logger.info(
                "starting rollout pool engine %d (the pool has %d engines up, %d starting, %d wanted)",
                self._next_index - 1,
                len(self.engines),
                len(self.starting) - 1,
                target,
            )


def _said_up(index: int, done: Future) -> None:
    if not done.cancelled() and done.exception() is None:
        logger.info("rollout pool engine %d is up; the next rollout admits it, the newest weights first", index)
