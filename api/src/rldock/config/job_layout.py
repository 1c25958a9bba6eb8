"""A JobConfig's layout (rldock.contract.layout): its parallel sizes, devices and device groups,
read from the config once.

Without `groups` the layout seats the device groups the config counts from the algorithm catalogue
(rldock.contract.algorithms): a reference rank per stage sequence rank (PP x DP x CP; none under LoRA,
where the actor ranks run the reference pass; counted even where kl_coef 0 drops them), a critic rank
per stage sequence rank for the algorithms with a critic, and one reward model for a `model` reward term.
The runtime passes the groups its worker-state specs run instead (rldock.runtime.flow.states), which
this package cannot import; tests/unit/runtime/flow/test_states.py holds the two device counts equal.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rldock.contract.algorithms import needs_critic, needs_rollout
from rldock.contract.layout import DeviceGroup, JobLayout

if TYPE_CHECKING:  # the sections' checks (rollout.py) read the layout, and job.py composes the sections
    from rldock.config.job import JobConfig


def config_groups(cfg: JobConfig) -> tuple[DeviceGroup, ...]:
    """The device groups besides the actor ranks that the config counts (module docstring)."""
    groups = []
    if cfg.training.lora is None:
        # a group of its own under CP (each CP group's Ulysses passes) and PP (its stages pass activations on)
        training = cfg.training
        split = training.context_parallel_size > 1 or training.pipeline_parallel_size > 1
        groups.append(DeviceGroup("reference", "stage_sequence_ranks", distinct=split))
    if needs_critic(cfg.algorithm.name):
        groups.append(DeviceGroup("critic", "stage_sequence_ranks", distinct=True))  # the actor's ranks without TP
    if cfg.reward.model_term_index is not None and needs_rollout(cfg.algorithm.name):
        groups.append(DeviceGroup("reward_model"))
    return tuple(groups)


def job_layout(cfg: JobConfig, *, groups: Sequence[DeviceGroup] | None = None) -> JobLayout:
    """`cfg`'s layout seating `groups` (default: `config_groups`)."""
    training, resources = cfg.training, cfg.resources
    return JobLayout(
        dp=training.data_parallel_size,
        tp=training.tensor_parallel_size,
        cp=training.context_parallel_size,
        ep=training.expert_parallel_size,
        pp=training.pipeline_parallel_size,
        generation_tp=cfg.rollout.tensor_parallel_size,
        num_nodes=resources.num_nodes,
        devices_per_node=resources.devices_per_node,
        placement=resources.placement,
        accelerator=resources.accelerator_resource,
        groups=config_groups(cfg) if groups is None else tuple(groups),
    )
