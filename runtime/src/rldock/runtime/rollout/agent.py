"""The agent rollout (a job with an `agent` section): one multi-turn episode per sample, with tools
and an environment, run by the rank's AgentSampler (rldock.runtime.rollout.agent_episodes); the episodes'
trajectories and counts become the dock's columns, written when the rank's batch has ended. Held-out
evaluation runs episodes too, and answers with each one's final turn.

With partial rollout (rollout.partial_rollout resume) the generation that runs ahead of a weight update
is the episodes' first round: each episode stops after rollout.max_tokens_per_round sampled tokens (the
turn being sampled cut there, its tools and environment step still running, its session open), and
`finish`, after the update, runs them to their ends on the new weights (agent/episode_loop.py, "Rounds").
A batch with an episode left over is written once all have ended, each row tagged with the version of
its first round (the oldest, which the dock's staleness bound sees) and each token with its own
(`token_policy_version`); the old-logprob pass keeps the engine's logprob for the tokens an older
version sampled, so the update's ratio is against the policy that sampled each token. No episode is
dropped: every episode started in the first round is finished in the second, so none is older than
one version when it trains, and the second round starts none.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from tensordict import TensorDict

from rldock.runtime.agent.episode_loop import Rollout
from rldock.runtime.agent.episode_metrics import Sums, merged_sums
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageFn, StageResult
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.rollout.agent_episodes import TOKEN_POLICY_VERSION, AgentSampler
from rldock.runtime.rollout.protocol import (
    HeldOutRequest,
    RolloutMode,
    RolloutRequest,
    RolloutSetup,
    decode_steps,
    run_rollout_stage,
    unpadded,
)


@dataclass
class HeldBatch:
    """A batch of episodes the first round left unfinished: its dock rows and the version of that round."""

    rows: torch.Tensor  # (B,)
    rollout: Rollout
    policy_version: int


class AgentRollout(RolloutMode):
    def __init__(self, setup: RolloutSetup, sampler: AgentSampler):
        self.setup, self.sampler = setup, sampler
        self._held: dict[int, list[HeldBatch]] = {}  # iteration -> its batches waiting for the second round

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> StageResult:
        """The episodes of this rank's batches; with `round_tokens` (partial rollout, a weight update
        follows) a batch whose episodes did not all end within the budget is kept for `finish`."""
        lengths: list[int] = []
        sums: list[Sums] = []
        held: list[HeldBatch] = []

        def rollout(indices: torch.Tensor, batch: TensorDict) -> TensorDict | None:
            episodes = self.sampler.start(
                engine,
                unpadded(batch["prompt_ids"], batch["prompt_mask"]),
                keys=episode_keys(self.setup, indices, request),
                prompt_indices=batch["prompt_index"].tolist(),
                seed=request.iteration,
            )
            self.sampler.advance(
                engine, episodes, policy_version=request.policy_version, round_tokens=request.round_tokens
            )
            if not episodes.done:
                held.append(HeldBatch(indices, episodes, request.policy_version))
                return None
            columns, batch_sums, batch_lengths = self.sampler.columns(
                engine, episodes, policy_version=request.policy_version
            )
            sums.append(batch_sums)
            lengths.extend(batch_lengths)
            return columns

        result = episode_stage(dock, self.setup, rollout, request=request, lengths=lengths, sums=sums)
        if held:
            self._held[request.iteration] = held
        return result.with_metrics(
            partial_cut=sum(len(batch.rollout.waiting) + len(batch.rollout.out) for batch in held)
        )

    def finish(
        self, engine: VllmRolloutEngine, dock: TransferDock, *, iteration: int, policy_version: int
    ) -> StageResult:
        """The second round of `iteration`, after the weight update: the held batches' episodes run to
        their ends on the weights of `policy_version`, then each batch is written."""
        held = self._held.pop(iteration, [])
        started = time.perf_counter()
        resumed = carried = newer = 0
        outputs = []
        for batch in held:
            unfinished = {*batch.rollout.waiting, *batch.rollout.out.values()}
            resumed += len(unfinished)
            before = sum(batch.rollout.episodes[i].num_sampled_tokens for i in unfinished)
            self.sampler.advance(engine, batch.rollout, policy_version=policy_version)
            carried += before
            newer += sum(batch.rollout.episodes[i].num_sampled_tokens for i in unfinished) - before
            outputs.append(self.sampler.columns(engine, batch.rollout, policy_version=batch.policy_version))
        return write_held(
            dock,
            held,
            outputs,
            compute_s=time.perf_counter() - started,
            resumed=resumed,
            carried=carried,
            newer=newer,
        )

    def older_tokens(self, batch: TensorDict, *, policy_version: int) -> torch.Tensor | None:
        return episode_older_tokens(batch, policy_version=policy_version)

    def evaluate(self, engine: VllmRolloutEngine, request: HeldOutRequest) -> dict:
        """Also each episode's `environment_rewards` per step and the episodes' metric sums (`agent`).
        An episode's length is the agent's (algorithm.max_response_length over all its turns), not
        the request's `max_tokens`."""
        k = request.num_samples
        prompts, contexts = request.prompts, request.contexts or [None] * len(request.prompts)
        finals, sums, rewards = self.sampler.evaluate(
            engine,
            [prompt for prompt in prompts for _ in range(k)],
            keys=[key * k + j for key in request.prompt_keys for j in range(k)],
            contexts=[c for c in contexts for _ in range(k)],
            seed=request.seed,
            greedy=request.greedy,
        )
        return {
            "responses": [finals[i : i + k] for i in range(0, len(finals), k)],
            "environment_rewards": [rewards[i : i + k] for i in range(0, len(rewards), k)],
            "agent": sums,
        }


class HeldRows(Protocol):
    """A batch the first round left unfinished, as the second round writes it: its dock rows (B,) and the
    version of the first round."""

    rows: torch.Tensor
    policy_version: int


def write_held(
    dock: TransferDock,
    held: Sequence[HeldRows],
    outputs: Sequence[tuple[TensorDict, Sums, list[int]]],
    *,
    compute_s: float,
    resumed: int,
    carried: int,
    newer: int,
) -> StageResult:
    """The second round's end: each held batch's (columns, metric sums, response lengths) in `outputs` written
    with the version of its first round; the stage's result with the counts of the episodes `resumed` and of
    their tokens sampled before the update (`carried`) and after it (`newer`)."""
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


def episode_older_tokens(batch: TensorDict, *, policy_version: int) -> torch.Tensor | None:
    """An agent's RolloutMode.older_tokens: with partial rollout, whose episodes' columns hold each token's
    version, the tokens another version sampled; without, none."""
    if TOKEN_POLICY_VERSION not in batch.keys():
        return None
    return token_older_than(batch[TOKEN_POLICY_VERSION], current_version=policy_version)


def token_behaviour_logprobs(
    computed: torch.Tensor, sampled: torch.Tensor, token_version: torch.Tensor, *, current_version: int
) -> torch.Tensor:
    """Old logprobs (B, SL) against the policy that sampled each token: `computed` (B, SL) by the weights
    of `current_version` where those sampled the token (and on tokens no version sampled, -1 in
    `token_version` (B, SL), which no loss reads), the engine's `sampled` (B, SL) where another did."""
    older = token_older_than(token_version, current_version=current_version)
    return torch.where(older, sampled.to(computed.dtype), computed)


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
    timing = run_rollout_stage(dock, setup, rollout, policy_version=request.policy_version)
    timing.metrics["decode_steps"] = decode_steps(lengths)
    if sums:
        timing.metrics["agent"] = merged_sums(sums)
    return timing
