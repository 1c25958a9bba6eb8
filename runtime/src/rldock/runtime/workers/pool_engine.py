"""The rollout pool's engine worker (rollout.pool): one Ray actor on a device of its own that only generates.

It holds a vLLM engine started from the policy's files and the job's rollout (rldock.runtime.rollout, built as an
actor rank builds it), and no trainer: it takes whole prompt groups of the rollout state from the dock beside the
actor ranks' engines, and between rollouts loads each policy version the update publishes (`load_weights`, queued
by the driver before its next rollout: Ray runs one actor's calls in the order they were submitted). Its device is
never shared, so the engine never sleeps. The driver keeps the pool (rldock.runtime.driver.rollout_pool).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rldock.config import JobConfig
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.engines.rank_engine import PublishedWeights, engine_batch_size
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import ROLLOUT, StageCall
from rldock.runtime.models.loading import load_tokenizer
from rldock.runtime.rollout.modes import build_rollout
from rldock.runtime.rollout.protocol import RolloutMode, request_of
from rldock.runtime.startup import collections_paused
from rldock.runtime.workers.threads import apply_thread_budget


def pool_rank(index: int, *, num_actor_ranks: int) -> int:
    """The rank pool engine `index` asks the dock as: after the actor ranks', so no two consumers share one."""
    return num_actor_ranks + index


class PoolEngineWorker:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        recipe: Recipe,
        index: int,
        num_actor_ranks: int,
        policy_dir: str,
        banks: DockBanks,
        policy_version: int,
        environment_urls: Mapping[str, Sequence[str]] | None = None,
    ):
        self.index, self.banks = index, banks
        self.policy_version = policy_version  # the files' weights: the actor ranks' at the attempt's start
        self.last_load: dict[str, float] = {}  # the last load's seconds, reported with the next rollout
        device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, recipe, device_kind=device.kind, role=f"rollout pool engine {index}")
        tokenizer = load_tokenizer(policy_dir)
        algo = cfg.algorithm
        with collections_paused():  # vLLM's import and the engine's build (rldock.runtime.startup)
            # A device of its own: vLLM sizes its KV cache from rollout.gpu_memory_utilization (on CPU, by
            # planning/cpu_kv_cache.py), with no training state beside it.
            self.engine = VllmRolloutEngine(
                policy_dir,
                rollout=cfg.rollout,
                dtype=cfg.model.dtype,
                seed=cfg.seed,
                max_model_len=algo.max_prompt_length + algo.max_response_length,
                device=device,
            )
        self.rollout: RolloutMode = build_rollout(
            cfg,
            tokenizer=tokenizer,
            rank=pool_rank(index, num_actor_ranks=num_actor_ranks),
            batch_size=engine_batch_size(cfg, num_actor_ranks=num_actor_ranks),
            spec=recipe.spec(ROLLOUT.name),
            environment_urls=environment_urls,
        )

    def load_weights(self, published: PublishedWeights) -> float:
        """Policy version `published.version` into the engine; returns the seconds it took."""
        loaded_s = self.engine.update_weights(published.named_tensors())
        self.policy_version = published.version
        self.last_load = {"pool_publish_copy_s": published.copy_s, "pool_weights_load_s": loaded_s}
        return loaded_s

    def generate(self, call: StageCall, *, version: int | None = None, batch_size: int | None = None) -> StageResult:
        """Whole prompt groups of the rollout state into the dock while any are left, sampled by the version
        this engine holds (ActorWorker.generate's, without a device turn: the device is the engine's). `version`:
        the one it must hold (a load that failed leaves an older one, which must not sample unnoticed);
        `batch_size`: samples per dock request, over the engines up now (None: over rollout.pool.replicas)."""
        if version is not None and version != self.policy_version:
            raise RuntimeError(
                f"rollout pool engine {self.index} holds policy version {self.policy_version}, not {version}: "
                "its last load of the published weights failed (see its error above)"
            )
        request = request_of(call, policy_version=self.policy_version, batch_size=batch_size)
        result = self.rollout.generate(self.engine, self.banks.bank(call.iteration), request)
        last_load, self.last_load = self.last_load, {}
        # by engine, as a dict: DAPO's rounds merge a position's results key by key (driver/feed.py)
        return result.with_metrics(pool_samples={f"engine{self.index}": result.num_samples}, **last_load)
