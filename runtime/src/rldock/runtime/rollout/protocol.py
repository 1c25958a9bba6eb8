"""The rollout mode protocol and what the modes share.

A mode is how one actor rank's engine generates an iteration's responses into the dock: it reads
whole prompt groups of the `rollout` state (the rank's generation replica's share), writes the
response columns (rldock.runtime.flow.columns) tagged with the policy version of the weights in the
engine (each response's length among them: the driver reads it from the dock), and returns the
stage's timing with its `decode_steps` and its own counts. The same object
answers the two other questions whose answer depends on how the responses were sampled: which tokens a
version older than the old-logprob pass's sampled (`older_tokens`, whose engine logprobs that pass keeps:
`sampling_logprobs`, and leaves out of the gap it measures) and the held-out evaluation's responses.

Built once per actor rank from the config (modes.py: `build_rollout`); the actor asks its mode and
never branches on which one runs. A mode subclasses `RolloutMode` explicitly to take its defaults,
which are what a mode with one round, one policy version per response and single-turn responses
does; it overrides what it changes (partial rollout: `finish` and `older_tokens`; agent
episodes: `evaluate`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.agent.interfaces import EpisodeContext
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageFn, StageResult, StageSpec, run_stage
from rldock.runtime.engines.vllm_rollout import Completion, VllmRolloutEngine
from rldock.runtime.flow.columns import AGENT_PARTIAL_ROLLOUT, PARTIAL_ROLLOUT
from rldock.runtime.flow.states import StageCall

SAMPLED_LOGPROBS, _ = PARTIAL_ROLLOUT  # the engine's logprob of each sampled token


@dataclass(frozen=True)
class RolloutSetup:
    """What every mode needs of the job and of its actor rank, fixed at start."""

    rank: int  # the actor rank asking the dock
    batch_size: int  # samples per dock request: the rank's generation replica's share
    spec: StageSpec  # the job recipe's rollout state: the dock state every mode asks, the columns it reads
    num_responses: int  # N: the responses of a prompt, consecutive rows of one group
    max_response_length: int  # SL
    eos_token_id: int
    pad_token_id: int
    num_prompts_per_iteration: int  # G
    rows_per_episode: int = 1  # S: a sample's dock rows (JobConfig.rows_per_episode: a harness's segments)

    @property
    def keeps_logprobs(self) -> bool:
        """Whether the mode writes the engine's logprob of each sampled token (`sampled_logprobs`): where the
        job recipe's rollout state produces it (rollout.return_logprobs, the mismatch's measure, partial
        rollout's older tokens)."""
        return SAMPLED_LOGPROBS in getattr(self.spec, "produces", ())

    @property
    def engine_columns(self) -> list[str]:
        """Which of an agent's per-token columns (each token's sampling logprob and version) the job recipe's
        rollout state writes."""
        return [name for name in AGENT_PARTIAL_ROLLOUT if name in getattr(self.spec, "produces", ())]

    @property
    def num_samples_per_iteration(self) -> int:
        """G*N: the iteration's samples (episodes), whatever their rows."""
        return self.num_prompts_per_iteration * self.num_responses


def sampled_logprobs(completions: Sequence[Sequence[Completion]], max_response_length: int) -> torch.Tensor:
    """The engine's logprob of each sampled token, (B, SL) float32, 0 past a response; rows in the
    order group_columns writes them (each prompt's N completions in turn)."""
    rows = [c.logprobs or [] for group in completions for c in group]
    logprobs = torch.zeros(len(rows), max_response_length, dtype=torch.float32)  # (B, SL)
    for i, row in enumerate(rows):
        logprobs[i, : len(row)] = torch.tensor(row[:max_response_length], dtype=torch.float32)
    return logprobs


def rollout_setup(cfg: JobConfig, *, tokenizer, rank: int, batch_size: int, spec: StageSpec) -> RolloutSetup:
    algo = cfg.algorithm
    return RolloutSetup(
        rank=rank,
        batch_size=batch_size,
        spec=spec,
        num_responses=algo.num_responses_per_prompt,
        max_response_length=algo.max_response_length,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_prompts_per_iteration=algo.num_prompts_per_iteration,
        rows_per_episode=cfg.rows_per_episode,
    )


@dataclass(frozen=True, kw_only=True)
class RolloutRequest:
    """One rollout call: `iteration`'s prompt groups, sampled by the weights of `policy_version`
    (updates behind them). `sampling_round` counts DAPO's rounds within the iteration (each round's
    groups get their own seeds); `round_tokens` is partial rollout's budget when a weight update
    follows (None: generate to completion); `ahead` is carried episodes' prompt groups handed ahead
    (StageCall.ahead)."""

    iteration: int
    policy_version: int
    sampling_round: int = 0
    round_tokens: int | None = None
    ahead: TensorDict | None = None
    batch_size: int | None = None  # samples per dock request; None: the rank's own (RolloutSetup.batch_size)


def request_of(call: StageCall, *, policy_version: int, batch_size: int | None = None) -> RolloutRequest:
    """The rollout request of a stage `call` on an engine holding the weights of `policy_version`."""
    return RolloutRequest(
        iteration=call.iteration,
        policy_version=policy_version,
        sampling_round=call.sampling_round,
        round_tokens=call.round_tokens,
        ahead=call.ahead,
        batch_size=batch_size,
    )


@dataclass(frozen=True, kw_only=True)
class HeldOutRequest:
    """Held-out responses (ActorWorker.evaluate): `num_samples` per prompt of at most `max_tokens`
    (greedy or sampled), seeded by (`seed`, the prompt's key); `contexts` are the prompts' rows an
    agent's environment checks against; `tasks` are what a harness gets of each prompt's row (rollout/harness.py's
    `task_of`: the prompt as stored, ground truth, data source, extra info)."""

    prompts: list[list[int]]
    num_samples: int
    greedy: bool
    max_tokens: int
    seed: int
    prompt_keys: list[int]
    contexts: list[EpisodeContext | None] | None = None
    tasks: list[dict] | None = None


class RolloutMode(Protocol):
    """One actor rank's rollout: the engine given is the rank's own, awake; the caller puts it to
    sleep after each call (the device is the trainer's until the next generation)."""

    setup: RolloutSetup

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> StageResult:
        """Generate this rank's share of the request's prompt groups into `dock`; the stage's timing
        (StageResult.as_dict) with `decode_steps`."""
        ...

    def finish(
        self, engine: VllmRolloutEngine, dock: TransferDock, *, iteration: int, policy_version: int
    ) -> StageResult:
        """The second round, after the weight update that cut `iteration`'s generation. Only partial
        rollout has one, and the trainer calls it only with rollout.partial_rollout on."""
        raise RuntimeError(
            f"{type(self).__name__} has no second round: finish_rollout runs only with rollout.partial_rollout on"
        )

    def older_tokens(self, batch: TensorDict, *, policy_version: int) -> torch.Tensor | None:
        """(B, SL) bool: the response tokens of `batch` a version older than `policy_version` sampled (a
        partial rollout's cut responses, an agent's episodes across an update), whose engine logprobs
        (`sampled_logprobs`) the batch carries. None: the weights of `policy_version` sampled them all,
        as here."""
        return None

    def evaluate(self, engine: VllmRolloutEngine, request: HeldOutRequest) -> dict:
        """`responses`: per prompt `num_samples` token id lists, EOS included when generated. Here one
        engine request per prompt."""
        completions = engine.sample(
            request.prompts,
            n=request.num_samples,
            max_tokens=request.max_tokens,
            eos_token_id=self.setup.eos_token_id,
            seed=request.seed,
            greedy=request.greedy,
            prompt_keys=request.prompt_keys,
        )
        return {"responses": [[c.token_ids for c in group] for group in completions]}


def decode_steps(lengths: Sequence[int]) -> int:
    """The engine's decode steps of a call that sampled responses of `lengths` tokens together: its
    longest response's, less the last token, never fed back (driver/utilisation.py: mbu/rollout)."""
    return max(max(lengths, default=0) - 1, 0)


def unpadded(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Each row's prompt tokens (B rows of (PL,), left-padded) without the padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]


def group_prompts(batch: TensorDict, group: int) -> list[list[int]]:
    """The prompt of each whole group in `batch`: the dock holds it once per sample, the engine gets
    one request per group."""
    return unpadded(batch["prompt_ids"][::group], batch["prompt_mask"][::group])


def group_request(
    setup: RolloutSetup, indices: torch.Tensor, request: RolloutRequest, *, max_tokens: int
) -> dict[str, Any]:
    """The engine's arguments for the whole groups at dock `indices` (B,): N responses per prompt of
    at most `max_tokens`. Seeded by (job seed, iteration, round, group index): a resumed run, or
    the same group landing on another rank, samples the same responses."""
    group = setup.num_responses
    keys = indices[::group] // group + request.sampling_round * setup.num_prompts_per_iteration  # (B/N,)
    return {
        "n": group,
        "max_tokens": max_tokens,
        "eos_token_id": setup.eos_token_id,
        "seed": request.iteration,
        "prompt_keys": keys.tolist(),
    }


def group_columns(
    per_prompt: Sequence[Sequence[Sequence[int]]], setup: RolloutSetup, *, policy_version: int
) -> TensorDict:
    """The (responses, mask, length, policy version) columns of whole groups, N rows per prompt in order."""
    rows = [tokens for group_responses in per_prompt for tokens in group_responses]
    responses = torch.full((len(rows), setup.max_response_length), setup.pad_token_id, dtype=torch.int64)  # (B, SL)
    mask = torch.zeros_like(responses)
    for i, tokens in enumerate(rows):
        responses[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
        mask[i, : len(tokens)] = 1
    versions = torch.full((len(rows),), policy_version, dtype=torch.int64)  # (B,)
    return TensorDict(
        {
            "response_ids": responses,
            "response_mask": mask,
            "response_length": torch.tensor([len(tokens) for tokens in rows], dtype=torch.int64),  # (B,)
            "policy_version": versions,
        },
        batch_size=[len(rows)],
    )


class TimedWrites:
    """Dock writes a mode makes from inside its stage function (groups written as they are ready),
    timed so that the stage books them as data movement, not generation."""

    def __init__(self, dock: TransferDock):
        self.dock, self.seconds = dock, 0.0

    def put(self, rows: torch.Tensor, out: TensorDict, *, policy_version: int) -> None:
        started = time.perf_counter()
        self.dock.put(rows, out, policy_version=policy_version)
        self.seconds += time.perf_counter() - started


def run_rollout_stage(
    dock: TransferDock,
    setup: RolloutSetup,
    fn: StageFn,
    *,
    policy_version: int,
    writes: TimedWrites | None = None,
    batch_size: int | None = None,
) -> StageResult:
    """Run `fn` over this rank's whole groups of the rollout state, `batch_size` samples a request (None:
    the setup's); what it returns is written tagged with `policy_version`, what it wrote itself through
    `writes` is moved from compute to dispatch."""
    timing = run_stage(
        dock,
        setup.spec,
        fn,
        rank=setup.rank,
        batch_size=setup.batch_size if batch_size is None else batch_size,
        whole_groups=True,
        policy_version=policy_version,
    )
    if writes is not None:
        timing.compute_s -= writes.seconds
        timing.dispatch_s += writes.seconds
    return timing


def sampling_logprobs(computed: torch.Tensor, batch: TensorDict, older: torch.Tensor | None) -> torch.Tensor:
    """The old-logprob pass's result (B, SL) from `computed` (B, SL), the logprobs under the weights that ran
    the pass: each token's logprob under the weights that sampled it, the engine's (`sampled_logprobs`) where
    an older version did (`older`: RolloutMode.older_tokens' answer)."""
    if older is None:
        return computed
    return torch.where(older, batch[SAMPLED_LOGPROBS].to(computed.dtype), computed)
