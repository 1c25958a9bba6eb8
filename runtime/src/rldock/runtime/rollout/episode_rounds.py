"""The round policy of the episode sources, written once: an agent's native loop (rollout/agent.py) and a
user's harness through the gateway (rollout/harness.py) each run a batch's episodes, and with partial rollout
(rollout.partial_rollout resume) the generation that runs ahead of a weight update is their first round: a
batch whose episodes did not all end within rollout.max_tokens_per_round sampled tokens each is held, and
`finish`, after the update, runs them to their ends on the new weights, then writes each held batch tagged
with the version of its first round (the oldest, which the dock's staleness bound sees) while each token
keeps its own (`token_policy_version`), so the old-logprob pass keeps the engine's logprob for the tokens an
older version sampled (`older_tokens`). No episode is dropped and the second round starts none.

`EpisodeRounds` is that policy; a source is a subclass that says how its episodes start, advance a round,
become dock columns and which are still running (`start`, `advance`, `columns`, `running`, `sampled_tokens`).
Carried episodes (rollout/agent_carry.py) replace `generate` with their own admission and cut.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from rldock.runtime.agent.episode_metrics import Sums, merged_sums
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageFn, StageResult
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.rollout.protocol import (
    RolloutMode,
    RolloutRequest,
    RolloutSetup,
    decode_steps,
    run_rollout_stage,
)
from rldock.runtime.rollout.trajectory_rows import TOKEN_POLICY_VERSION

# An ended batch as a source writes it: its dock columns, its episodes' metric sums, its response lengths.
Written = tuple[TensorDict, Sums, list[int]]


@dataclass
class HeldBatch:
    """A batch of episodes the first round left running: its dock rows (B,), the source's episodes, and the
    version of that round."""

    rows: torch.Tensor
    episodes: Any
    policy_version: int


class EpisodeRounds(RolloutMode):
    """Generate a rank's batches of episodes, holding those a round's budget cut until `finish`."""

    setup: RolloutSetup

    def __init__(self, setup: RolloutSetup) -> None:
        self.setup = setup
        self._held: dict[int, list[HeldBatch]] = {}  # iteration -> its batches waiting for the second round

    # The source's part: abstract, so a source that misses one cannot be built (RolloutMode's metaclass is ABCMeta).
    @abstractmethod
    def start(self, engine: VllmRolloutEngine, indices: torch.Tensor, batch: TensorDict, request: RolloutRequest):
        """The episodes of the dock batch (`indices`, `batch`), started (nothing sampled yet)."""

    @abstractmethod
    def advance(
        self, engine: VllmRolloutEngine, episodes, *, policy_version: int, round_tokens: int | None = None
    ) -> bool:
        """Run a round of `episodes` on the weights of `policy_version`, each sampling at most `round_tokens`
        (None: to their ends); whether every episode has ended."""

    @abstractmethod
    def columns(self, engine: VllmRolloutEngine, episodes, *, policy_version: int) -> Written:
        """Ended `episodes` as the dock's rows, each tagged with `policy_version`."""

    @abstractmethod
    def running(self, episodes) -> Collection:
        """The episodes (by the source's keys) the first round left running."""

    @abstractmethod
    def sampled_tokens(self, episodes, keys: Collection) -> int:
        """Tokens the episodes `keys` have sampled so far, every round."""

    # The round policy.
    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> StageResult:
        """The episodes of this rank's batches; with `round_tokens` (partial rollout, a weight update
        follows) a batch whose episodes did not all end within the budget is kept for `finish`."""
        lengths: list[int] = []
        sums: list[Sums] = []
        held: list[HeldBatch] = []

        def rollout(indices: torch.Tensor, batch: TensorDict) -> TensorDict | None:
            episodes = self.start(engine, indices, batch, request)
            if not self.advance(
                engine, episodes, policy_version=request.policy_version, round_tokens=request.round_tokens
            ):
                held.append(HeldBatch(indices, episodes, request.policy_version))
                return None
            columns, batch_sums, batch_lengths = self.columns(engine, episodes, policy_version=request.policy_version)
            sums.append(batch_sums)
            lengths.extend(batch_lengths)
            return columns

        result = episode_stage(dock, self.setup, rollout, request=request, lengths=lengths, sums=sums)
        if held:
            self._held[request.iteration] = held
        return result.with_metrics(partial_cut=sum(len(self.running(batch.episodes)) for batch in held))

    def finish(
        self, engine: VllmRolloutEngine, dock: TransferDock, *, iteration: int, policy_version: int
    ) -> StageResult:
        """The second round of `iteration`, after the weight update: the held batches' episodes run to their
        ends on the weights of `policy_version`, then each batch is written with the version of its first
        round; the counts of the episodes resumed and of their tokens sampled before the update (carried)
        and after it (newer)."""
        held = self._held.pop(iteration, [])
        started = time.perf_counter()
        resumed = carried = newer = 0
        outputs = []
        for batch in held:
            cut = set(self.running(batch.episodes))
            before = self.sampled_tokens(batch.episodes, cut)
            self.advance(engine, batch.episodes, policy_version=policy_version)
            resumed, carried = resumed + len(cut), carried + before
            newer += self.sampled_tokens(batch.episodes, cut) - before
            outputs.append(self.columns(engine, batch.episodes, policy_version=batch.policy_version))
        return write_held(
            dock, held, outputs, compute_s=time.perf_counter() - started, resumed=resumed, carried=carried, newer=newer
        )

    def older_tokens(self, batch: TensorDict, *, policy_version: int) -> torch.Tensor | None:
        """With partial rollout, whose episodes' columns hold each token's version, the tokens another version
        sampled; without, none."""
        if TOKEN_POLICY_VERSION not in batch.keys():
            return None
        return token_older_than(batch[TOKEN_POLICY_VERSION], current_version=policy_version)


def write_held(
    dock: TransferDock,
    held: Sequence[HeldBatch],
    outputs: Sequence[Written],
    *,
    compute_s: float,
    resumed: int,
    carried: int,
    newer: int,
) -> StageResult:
    """The second round's end: each held batch's `outputs` written with the version of its first round; the
    stage's result with the counts of the episodes `resumed` and of their tokens sampled before the update
    (`carried`) and after it (`newer`)."""
    written = time.perf_counter()
    for batch, (columns, _, _) in zip(held, outputs):
        dock.put(batch.rows, columns, policy_version=batch.policy_version)
    return StageResult(
        dispatch_s=time.perf_counter() - written,
        compute_s=compute_s,
        num_samples=sum(len(batch.rows) for batch in held),
        metrics={
            "decode_steps": decode_steps([length for _, _, lengths in outputs for length in lengths]),
            "partial_resumed": resumed,
            "partial_carried_tokens": carried,
            "partial_newer_tokens": newer,
            **({"agent": merged_sums([sums for _, sums, _ in outputs])} if outputs else {}),
        },
    )


def token_older_than(token_version: torch.Tensor, *, current_version: int) -> torch.Tensor:
    """(B, SL) bool: the tokens a version other than `current_version` sampled, from each token's version
    (B, SL), -1 where no version sampled it (the tools', the environment's, padding)."""
    return (token_version >= 0) & (token_version != current_version)


def episode_keys(setup: RolloutSetup, indices: torch.Tensor, request: RolloutRequest) -> list[int]:
    """One episode per sample at dock `indices` (B,): seeded by its index, offset per DAPO round."""
    return (indices + request.sampling_round * setup.num_samples_per_iteration).tolist()


def episode_stage(
    dock: TransferDock,
    setup: RolloutSetup,
    rollout: StageFn,
    *,
    request: RolloutRequest,
    lengths: list[int],
    sums: list[Sums],
) -> StageResult:
    """Run `rollout` (which fills `lengths` and `sums` as it goes) as the rollout stage: its timing with the
    episodes' decode steps and metric sums (`agent`)."""
    timing = run_rollout_stage(
        dock, setup, rollout, policy_version=request.policy_version, batch_size=request.batch_size
    )
    timing.metrics["decode_steps"] = decode_steps(lengths)
    if sums:
        timing.metrics["agent"] = merged_sums(sums)
    return timing
