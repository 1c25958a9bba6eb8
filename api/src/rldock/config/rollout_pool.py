"""`rollout.pool`: generation engines on devices of their own, apart from the trainer's (docs/placement.md#the-
rollout-pool), with the checks that need more than one field (`problems`, rldock.config.problems.SECTION_CHECKS).

A pool engine only generates: it takes whole prompt groups of the rollout state from the dock beside the actor
ranks' engines, and loads each policy version the update publishes. What it cannot do yet is refused here, each
with its reason."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from rldock.config.problem import Problem
from rldock.config.section import Spec
from rldock.contract.algorithms import needs_rollout

if TYPE_CHECKING:
    from rldock.config.job import JobConfig

FIELD = "rollout.pool"


class RolloutPoolSpec(Spec):
    """A rollout pool: `replicas` vLLM engines, one device each, that generate beside the actor ranks' engines."""

    replicas: int = Field(
        ge=1,
        le=256,
        description="Engines of the pool, each a process of its own on one device apart from the trainer's (a local "
        "Ray gets these devices beside resources.num_nodes x resources.devices_per_node). Every engine, the "
        "actor ranks' and the pool's, takes whole prompt groups from the dock while any are left, so a free "
        "engine takes more; each pool engine loads every policy version the update publishes before its next "
        "rollout. An engine that dies costs the job that engine: its unfinished groups go back to the dock and "
        "the others generate them (docs/placement.md#the-rollout-pool).",
    )
    actors_generate: bool = Field(
        default=True,
        description="Whether the actor ranks' engines generate beside the pool's. false: the pool alone generates "
        "and the trainer's devices only train (their engines still run the held-out evaluation). Either way, "
        "losing the last pool engine waits for another (at most 10 minutes) before it fails the attempt.",
    )


def pool_devices(cfg: JobConfig) -> int:
    """Devices the job's rollout pool takes beside the trainer's (0: no pool)."""
    pool = cfg.rollout.pool
    return 0 if pool is None else pool.replicas


def problems(cfg: JobConfig) -> list[Problem]:
    """What a pool engine does not do yet, each refused with its reason."""
    if cfg.rollout.pool is None:
        return []
    refused: list[Problem] = []
    if not needs_rollout(cfg.algorithm.name):
        refused.append(
            Problem(FIELD, f"algorithm {cfg.algorithm.name} trains on given responses: a pool has nothing to generate")
        )
    if cfg.rollout.partial_rollout != "off":
        refused.append(
            Problem(
                FIELD,
                f"rollout.partial_rollout {cfg.rollout.partial_rollout}: a cut generation goes on in the engine that "
                "cut it, across the update, which a pool engine does not keep yet; set rollout.partial_rollout off "
                "or remove rollout.pool",
            )
        )
    if cfg.rollout.tensor_parallel_size > 1:
        refused.append(
            Problem(
                FIELD,
                f"rollout.tensor_parallel_size {cfg.rollout.tensor_parallel_size}: a pool engine holds one device; "
                "set it to 1 or remove rollout.pool",
            )
        )
    training = cfg.training
    if training.strategy != "fsdp" and (training.tensor_parallel_size > 1 or training.resharding != "naive"):
        refused.append(
            Problem(
                FIELD,
                f"training.tensor_parallel_size {training.tensor_parallel_size} and training.resharding "
                f"{training.resharding} under DDP: the resharder loads the gathered weights into the actor ranks' "
                "engines only, and keeps no copy for a pool's engines yet; use training.strategy fsdp, or DDP with "
                "tensor_parallel_size 1 and resharding naive, or remove rollout.pool",
            )
        )
    if cfg.agent is not None and cfg.agent.harnessed:
        refused.append(
            Problem(
                FIELD,
                "a harness (agent.harness, agent.harness_command, agent.harness_pods) reaches the actor ranks' "
                "gateways only: remove rollout.pool or use the native agent loop",
            )
        )
    return refused
