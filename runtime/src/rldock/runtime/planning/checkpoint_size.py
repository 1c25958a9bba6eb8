"""What a checkpoint writes, and how long its save may take: the figure a preemption's grace period must hold
(spec.preemption.gracePeriodSeconds: the iteration under way, then this save) before any checkpoint was
measured.

A checkpoint (rldock.runtime.checkpoint) holds the whole policy in model.dtype (`policy/`, whatever the layout
that wrote it), AdamW's two moments of every trained weight in the same dtype (`optimizer.pt`; none for the
embedding and the head under training.freeze_embeddings), and for PPO the value model and its moments
(`critic.pt`, `critic_optimizer.pt`); the rest (RNG states, the prompt ledger, state.json) is kilobytes. Under
LoRA the figure is an overestimate: the optimizer holds the adapters' moments only.

The save writes those bytes once, at the storage's write rate, which the driver measures in its output folder
at the start (rldock.runtime.checkpoint.measure_write_rate: 32 MiB written and synced). The rest of a save
(gathering the weights whole, serialising each tensor into fresh memory, beside the job's other processes)
costs more than the write itself on a fast local disk: SmolLM2-135M's checkpoint (1.39 GB) took 2.85 and
3.08 s to save in two jobs on the 2-core machine, where the probe measured 1.4-1.8 GB/s (0.77-0.97 s of
writing: 3-4x less). The estimate allows SAVE_WORK_FACTOR times the write, so that it errs long (the grace
period it is held to then errs long too), plus SAVE_FIXED_S for what a save costs whatever its size (a call to
every worker, the RNG states, the prompt ledger, the renames: the demo's 6 MB took 0.03-0.08 s). The driver
reports the estimate on its progress lines until the first checkpoint's own seconds replace it
(`python -m rldock_benchmarks.checkpoint_save CONFIG` sets the two side by side).
"""

from __future__ import annotations

from dataclasses import dataclass

from rldock.config import JobConfig
from rldock.contract.algorithms import needs_critic
from rldock.runtime.planning.dtypes import DTYPE_BYTES
from rldock.runtime.planning.memory import critic_params
from rldock.runtime.planning.shapes import ModelShape


@dataclass(frozen=True)
class CheckpointBytes:
    policy: int  # policy/: the whole model in model.dtype
    optimizer: int  # optimizer.pt: AdamW's two moments of the trained weights
    critic: int = 0  # critic.pt and critic_optimizer.pt: the value model and its moments (PPO)

    @property
    def total(self) -> int:
        return self.policy + self.optimizer + self.critic


def checkpoint_bytes(cfg: JobConfig, shape: ModelShape) -> CheckpointBytes:
    """The bytes one checkpoint of `cfg`'s job writes (module docstring)."""
    element = DTYPE_BYTES[cfg.model.dtype]
    frozen = 0
    if cfg.training.freeze_embeddings:  # the embedding, and an untied head beside it
        frozen = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    critic = critic_params(shape) * element * 3 if needs_critic(cfg.algorithm.name) else 0
    return CheckpointBytes(
        policy=shape.num_params * element, optimizer=2 * (shape.num_params - frozen) * element, critic=critic
    )


# A save's seconds over its bytes' raw write at the measured rate (module docstring: 3-4x measured here), and
# what it costs whatever its size.
SAVE_WORK_FACTOR, SAVE_FIXED_S = 4.0, 0.1


def save_seconds(size: CheckpointBytes, *, write_rate: float) -> float:
    """The seconds a save of `size` should take where the storage writes `write_rate` bytes a second."""
    if write_rate <= 0:
        raise ValueError(f"write_rate must be positive, got {write_rate}")
    return SAVE_FIXED_S + SAVE_WORK_FACTOR * size.total / write_rate


@dataclass(frozen=True)
class SaveEstimate:
    """A checkpoint's bytes and the seconds its save should take at a storage's write rate (`rldock plan
    --write-rate`; the driver's own measure in a job)."""

    size: CheckpointBytes
    write_rate: float  # bytes a second

    @property
    def seconds(self) -> float:
        return save_seconds(self.size, write_rate=self.write_rate)
