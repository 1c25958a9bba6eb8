"""Partial rollout (rollout.partial_rollout): a generation that runs ahead of a weight update is cut
after rollout.max_tokens_per_round tokens, and its unfinished responses are completed after the
update under the new weights, from their prefix (`resume`) or from the prompt again (`drop`): a
`CutPolicy` each (`Resume`, `Drop`), which `PartialRollout` asks.

Where the cut falls: in async mode each actor rank runs, in its own process and in this order,
iteration i+1's first round (cut at the budget), iteration i's update, then i+1's second round
(`PartialRollout.finish`) and old-logprob pass. So a response spans at most two policy versions:
its first `prefix_length` tokens were sampled by the weights of `policy_version` (the oldest, which
the dock's staleness bound and the update's staleness metrics see), the rest by the next version.
Each token keeps the engine's logprob under the weights that sampled it (`sampled_logprobs`); the
old-logprob pass, which runs with the newer weights, takes those for the older tokens
(`behaviour_logprobs`), so the update's ratio is still against the policy that sampled each token.

A group is written to the dock once all its N responses are complete (the advantage normalises over
the group), so groups with a cut response wait for the second round; the others are written at once.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.engines.vllm_rollout import Completion, VllmRolloutEngine
from rldock.runtime.flow.columns import PARTIAL_ROLLOUT
from rldock.runtime.rollout.protocol import (
    RolloutMode,
    RolloutRequest,
    RolloutSetup,
    TimedWrites,
    decode_steps,
    group_prompts,
    group_request,
    run_rollout_stage,
)

logger = logging.getLogger(__name__)

SAMPLED_LOGPROBS, PREFIX_LENGTH = PARTIAL_ROLLOUT
# the second round's call seed is offset from the first's so that its requests draw other streams
_RESUME_SEED_OFFSET = 1 << 20
# partial_newer_tokens: tokens the newer version sampled in resumed responses (after the cut's older ones)
METRIC_KEYS = (
    "partial_cut",
    "partial_resumed",
    "partial_dropped",
    "partial_carried_tokens",
    "partial_dropped_tokens",
    "partial_newer_tokens",
)


@dataclass(frozen=True)
class Sampled:
    """One response as the rollout writes it: tokens, each token's logprob under the weights that
    sampled it, and how many leading tokens the older of its (at most two) versions sampled."""

    token_ids: list[int]
    logprobs: list[float]
    prefix_length: int


@dataclass(frozen=True)
class CutGroup:
    """A prompt group with at least one response cut by the round budget, kept until the update."""

    rows: list[int]  # dock indices of its N samples
    prompt: list[int]
    responses: list[Completion]  # the first round's, cut or finished
    policy_version: int  # the weights that sampled the first round
    round_tokens: int  # the first round's budget

    def cut_positions(self) -> list[int]:
        return [j for j, c in enumerate(self.responses) if is_cut(c, round_tokens=self.round_tokens)]


def is_cut(completion: Completion, *, round_tokens: int) -> bool:
    """A response the round budget stopped: `round_tokens` tokens long with no EOS at the end (one
    that ended with EOS on its last allowed token is finished)."""
    return len(completion.token_ids) >= round_tokens and not completion.finished_with_eos


class CutPolicy(ABC):
    """What the second round makes of a cut response (rollout.partial_rollout): `Resume` continues it from its
    prefix on the new weights, `Drop` samples it again from the prompt. `PartialRollout` asks its policy and
    never branches on which one it holds."""

    name: str
    verb: str  # what the second round did to the cut responses, for the log

    @abstractmethod
    def continuation_prompt(self, prompt: list[int], cut: Completion) -> list[int]:
        """What the engine is given in the second round for the cut response `cut` of `prompt`."""

    @abstractmethod
    def remaining(self, max_response_length: int, round_tokens: int) -> int:
        """The second round's token limit after a first round cut at `round_tokens`."""

    @abstractmethod
    def joined(self, cut: Completion, continuation: Completion, *, max_tokens: int) -> Sampled:
        """The complete response of `cut` after the second round's `continuation`, at most `max_tokens`
        (sampling past the limit and truncating gives the same distribution as stopping at it)."""

    @property
    @abstractmethod
    def rows_are_newer(self) -> bool:
        """Whether a replaced response is the newer version's alone (written with its version) rather than
        the older version's prefix and the newer's rest (written with the older one)."""

    @abstractmethod
    def counts(self, *, cut: int, older_tokens: int, newer_tokens: int) -> dict[str, int]:
        """The second round's counters (METRIC_KEYS but `partial_cut`) for `cut` cut responses whose first
        round sampled `older_tokens` and whose second `newer_tokens` (past the prefix)."""


class Resume(CutPolicy):
    name, verb = "resume", "resumed"

    def continuation_prompt(self, prompt: list[int], cut: Completion) -> list[int]:
        return prompt + list(cut.token_ids)

    def remaining(self, max_response_length: int, round_tokens: int) -> int:
        return max_response_length - round_tokens  # every cut prefix is the round budget long

    def joined(self, cut: Completion, continuation: Completion, *, max_tokens: int) -> Sampled:
        """Its prefix, then the second round's tokens; `prefix_length` counts the older version's."""
        tokens = (list(cut.token_ids) + list(continuation.token_ids))[:max_tokens]
        logprobs = (_logprobs_of(cut) + _logprobs_of(continuation))[:max_tokens]
        return Sampled(tokens, logprobs, prefix_length=min(len(cut.token_ids), len(tokens)))

    @property
    def rows_are_newer(self) -> bool:
        return False

    def counts(self, *, cut: int, older_tokens: int, newer_tokens: int) -> dict[str, int]:
        return {
            "partial_resumed": cut,
            "partial_dropped": 0,
            "partial_carried_tokens": older_tokens,
            "partial_newer_tokens": newer_tokens,
            "partial_dropped_tokens": 0,
        }


class Drop(CutPolicy):
    name, verb = "drop", "sampled again"

    def continuation_prompt(self, prompt: list[int], cut: Completion) -> list[int]:
        return list(prompt)

    def remaining(self, max_response_length: int, round_tokens: int) -> int:
        return max_response_length

    def joined(self, cut: Completion, continuation: Completion, *, max_tokens: int) -> Sampled:
        """The second round's response alone: all the newer version's, so its prefix is all of it."""
        return complete(continuation, max_tokens=max_tokens)

    @property
    def rows_are_newer(self) -> bool:
        return True

    def counts(self, *, cut: int, older_tokens: int, newer_tokens: int) -> dict[str, int]:
        return {
            "partial_resumed": 0,
            "partial_dropped": cut,
            "partial_carried_tokens": 0,
            "partial_newer_tokens": 0,
            "partial_dropped_tokens": older_tokens,
        }


CUT_POLICIES: dict[str, CutPolicy] = {policy.name: policy for policy in (Resume(), Drop())}


def complete(completion: Completion, *, max_tokens: int) -> Sampled:
    """A response sampled whole by one version."""
    tokens = list(completion.token_ids)[:max_tokens]
    return Sampled(tokens, _logprobs_of(completion)[: len(tokens)], prefix_length=len(tokens))


def _logprobs_of(completion: Completion) -> list[float]:
    if completion.logprobs is None:
        raise ValueError("partial rollout needs each sampled token's logprob; sample with logprobs=True")
    return list(completion.logprobs)


def response_columns(
    samples: list[Sampled], *, policy_version: int, max_response_length: int, pad_token_id: int
) -> TensorDict:
    """The rollout's dock columns for `samples`, one row each."""
    rows = len(samples)
    responses = torch.full((rows, max_response_length), pad_token_id, dtype=torch.int64)  # (B, SL)
    mask = torch.zeros_like(responses)
    logprobs = torch.zeros((rows, max_response_length), dtype=torch.float32)  # (B, SL)
    for i, sample in enumerate(samples):
        length = len(sample.token_ids)
        responses[i, :length] = torch.tensor(sample.token_ids, dtype=torch.int64)
        mask[i, :length] = 1
        logprobs[i, :length] = torch.tensor(sample.logprobs, dtype=torch.float32)
    return TensorDict(
        {
            "response_ids": responses,
            "response_mask": mask,
            "response_length": torch.tensor([len(s.token_ids) for s in samples], dtype=torch.int64),  # (B,)
            "policy_version": torch.full((rows,), policy_version, dtype=torch.int64),  # (B,)
            SAMPLED_LOGPROBS: logprobs,
            PREFIX_LENGTH: torch.tensor([s.prefix_length for s in samples], dtype=torch.int64),  # (B,)
        },
        batch_size=[rows],
    )


def behaviour_logprobs(
    computed: torch.Tensor,
    sampled: torch.Tensor,
    policy_version: torch.Tensor,
    prefix_length: torch.Tensor,
    *,
    current_version: int,
) -> torch.Tensor:
    """Old logprobs (B, SL) against the policy that sampled each token: `computed` (B, SL) by the
    weights of `current_version` where those sampled the token, the engine's `sampled` (B, SL)
    logprob where an older version did (`older_than`)."""
    older = older_than(policy_version, prefix_length, width=computed.shape[1], current_version=current_version)
    return torch.where(older, sampled.to(computed.dtype), computed)


def older_than(
    policy_version: torch.Tensor, prefix_length: torch.Tensor, *, width: int, current_version: int
) -> torch.Tensor:
    """(B, `width`) bool: the tokens a version other than `current_version` sampled. Token t of a sample
    was sampled by `policy_version` (B,) when t < `prefix_length` (B,), by the next version after it."""
    positions = torch.arange(width, device=policy_version.device)  # (SL,)
    token_version = policy_version[:, None] + (positions[None, :] >= prefix_length[:, None]).long()  # (B, SL)
    return token_version != current_version


class PartialRollout(RolloutMode):
    """One actor rank's rollout with partial rollout on (`policy`: what becomes of a cut response): the first
    round (cut at the budget when a weight update follows) and the second (the cut groups' responses completed
    after it)."""

    def __init__(self, setup: RolloutSetup, *, policy: CutPolicy):
        self.setup, self.policy = setup, policy
        self.group = setup.num_responses
        self.max_response_length = setup.max_response_length
        self._cut: dict[int, list[CutGroup]] = {}  # iteration -> its groups waiting for the second round

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> StageResult:
        """The first round: generate this rank's whole prompt groups with at most `round_tokens`
        tokens per response (None: to completion, nothing is cut); write the groups with no cut
        response and keep the others for `finish`."""
        round_tokens, policy_version = request.round_tokens, request.policy_version
        cut_groups: list[CutGroup] = []
        lengths: list[int] = []
        writes = TimedWrites(dock)
        max_tokens = round_tokens or self.max_response_length

        def rollout(indices: torch.Tensor, batch: TensorDict) -> None:
            prompts = group_prompts(batch, self.group)
            completions = engine.sample(
                prompts,
                **group_request(self.setup, indices, request, max_tokens=max_tokens),
                logprobs=True,
            )
            finished_rows, finished = [], []
            for position, responses in enumerate(completions):
                rows = indices[position * self.group : (position + 1) * self.group].tolist()
                if round_tokens is not None and any(is_cut(c, round_tokens=round_tokens) for c in responses):
                    cut_groups.append(CutGroup(rows, prompts[position], responses, policy_version, round_tokens))
                    continue
                finished_rows += rows
                finished += [complete(c, max_tokens=self.max_response_length) for c in responses]
            if finished:
                lengths.extend(len(s.token_ids) for s in finished)
                writes.put(
                    torch.tensor(finished_rows),
                    self._columns(finished, policy_version),
                    policy_version=policy_version,
                )

        timing = run_rollout_stage(dock, self.setup, rollout, policy_version=policy_version, writes=writes)
        if cut_groups:
            self._cut[request.iteration] = cut_groups
        num_cut = sum(len(g.cut_positions()) for g in cut_groups)
        return timing.with_metrics(decode_steps=decode_steps(lengths), partial_cut=num_cut)

    def finish(
        self, engine: VllmRolloutEngine, dock: TransferDock, *, iteration: int, policy_version: int
    ) -> StageResult:
        """The second round of `iteration`, after the weight update: complete every cut response
        under the weights of `policy_version` and write the held groups."""
        groups = self._cut.pop(iteration, [])
        started = time.perf_counter()
        cut = [(g, j) for g in range(len(groups)) for j in groups[g].cut_positions()]
        policy = self.policy
        prompts = [policy.continuation_prompt(groups[g].prompt, groups[g].responses[j]) for g, j in cut]
        remaining = policy.remaining(self.max_response_length, groups[0].round_tokens) if groups else 0
        continued = (
            engine.sample(
                prompts,
                n=1,
                max_tokens=remaining,
                eos_token_id=self.setup.eos_token_id,
                seed=iteration + _RESUME_SEED_OFFSET,
                logprobs=True,
                prompt_keys=[groups[g].rows[j] for g, j in cut],
            )
            if cut
            else []
        )
        replaced = {
            (g, j): policy.joined(groups[g].responses[j], more[0], max_tokens=self.max_response_length)
            for (g, j), more in zip(cut, continued)
        }
        compute_s = time.perf_counter() - started
        lengths: list[int] = []
        written = time.perf_counter()
        for g, group in enumerate(groups):
            # Rows sampled whole by the first round's weights, and rows sampled again whole by the newer ones
            # (`rows_are_newer`), are written with their own version; resumed rows with the older one.
            by_version: dict[int, tuple[list[int], list[Sampled]]] = {}
            for j, completion in enumerate(group.responses):
                sample = replaced.get((g, j)) or complete(completion, max_tokens=self.max_response_length)
                newer = policy.rows_are_newer and (g, j) in replaced
                rows, samples = by_version.setdefault(policy_version if newer else group.policy_version, ([], []))
                rows.append(group.rows[j])
                samples.append(sample)
            for version, (rows, samples) in by_version.items():
                lengths.extend(len(s.token_ids) for s in samples)
                dock.put(torch.tensor(rows), self._columns(samples, version), policy_version=version)
        carried = sum(len(groups[g].responses[j].token_ids) for g, j in cut)
        logger.debug(
            "iteration %d: %d cut responses %s (%d tokens of the older version)",
            iteration,
            len(cut),
            policy.verb,
            carried,
        )
        return StageResult(
            dispatch_s=time.perf_counter() - written,
            compute_s=compute_s,
            num_samples=len(groups) * self.group,
            metrics={
                "decode_steps": decode_steps(lengths),
                **policy.counts(
                    cut=len(cut),
                    older_tokens=carried,
                    newer_tokens=sum(len(s.token_ids) - s.prefix_length for s in replaced.values()),
                ),
            },
        )

    def older_tokens(self, batch: TensorDict, *, policy_version: int) -> torch.Tensor:
        """A resumed response's prefix, and any response an older version sampled whole (`older_than`)."""
        return older_than(
            batch["policy_version"],
            batch[PREFIX_LENGTH],
            width=batch[SAMPLED_LOGPROBS].shape[1],
            current_version=policy_version,
        )

    def _columns(self, samples: list[Sampled], policy_version: int) -> TensorDict:
        return response_columns(
            samples,
            policy_version=policy_version,
            max_response_length=self.max_response_length,
            pad_token_id=self.setup.pad_token_id,
        )
