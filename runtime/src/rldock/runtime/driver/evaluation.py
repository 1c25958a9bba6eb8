"""Held-out evaluation: the current policy answers validation prompts, the job's reward scores the
answers, and the scores become `val/...` metrics per data source (docs/evaluation.md).

The driver calls `Evaluator.run` between iterations, after the iteration's update has pushed its
weights into every rollout engine, so the engines hold exactly the policy being evaluated. The
prompts are dealt over all rollout engines (one per actor rank) in contiguous chunks and each rank
generates its chunk with `ActorWorker.evaluate`.

Evaluation samples never enter the transfer dock: they are not training samples, no stage but
this one reads them, and putting them there would take dock slots (and their accounting) from
the iteration's batch. Token ids go to the ranks and come back as Ray call arguments and results.

The interface is deliberately small: a list of `EvalExample`s and a `ScoreFn` from decoded
responses to rewards. Where the examples come from and which reward scores them is the caller's
business (the trainer's `heldout_evaluation`).
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from rldock.config.job import EvaluationSpec
from rldock.runtime.agent.episode_metrics import agent_metrics
from rldock.runtime.agent.interfaces import EpisodeContext
from rldock.runtime.rollout.protocol import HeldOutRequest

logger = logging.getLogger(__name__)

VAL_PREFIX = "val/"
# Sampled evaluation seeds prompt i with key EVAL_KEY_OFFSET + i, far from the training rollout's
# keys (group indexes), so evaluation never replays a training sample's random stream.
EVAL_KEY_OFFSET = 1 << 32


@dataclass(frozen=True)
class EvalExample:
    """One held-out prompt with what its reward needs."""

    prompt: str  # the text the policy continues (already rendered)
    ground_truth: str
    data_source: str  # the metrics group: `val/<data_source>/...`
    extra_info: dict[str, Any] = field(default_factory=dict)
    row_prompt: str | list | None = None  # the prompt as stored (text or chat messages), for TRL-form rewards
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for TRL-form rewards


# Rewards of decoded responses: `responses[i]` answers `examples[i]` (an example repeats once per
# sample); returns one float per response.
ScoreFn = Callable[[list[str], list[EvalExample]], list[float]]


def aggregate(
    *,
    data_sources: Sequence[str],
    rewards: Sequence[float],
    response_lengths: Sequence[int],
    num_prompts: int,
    correct_threshold: float,
) -> dict[str, float]:
    """`val/...` metrics of one evaluation from per-response values (all three sequences align).

    Per data source: `val/<source>/reward` (mean reward) and `val/<source>/accuracy` (share of
    responses with reward >= `correct_threshold`); over all responses: `val/reward`,
    `val/accuracy`, `val/response_length` (mean tokens, EOS included) and `val/num_prompts`.
    """
    if not len(data_sources) == len(rewards) == len(response_lengths):
        raise ValueError(
            f"{len(data_sources)} data sources, {len(rewards)} rewards and "
            f"{len(response_lengths)} lengths: one of each per response"
        )
    if not rewards:
        raise ValueError("no responses to aggregate: the held-out set is empty")
    by_source: dict[str, list[float]] = {}
    for source, reward in zip(data_sources, rewards):
        by_source.setdefault(source, []).append(reward)
    metrics: dict[str, float] = {}
    for source in sorted(by_source):
        values = by_source[source]
        metrics[f"{VAL_PREFIX}{source}/reward"] = statistics.fmean(values)
        metrics[f"{VAL_PREFIX}{source}/accuracy"] = _accuracy(values, correct_threshold)
    metrics.update(
        {
            f"{VAL_PREFIX}reward": statistics.fmean(rewards),
            f"{VAL_PREFIX}accuracy": _accuracy(rewards, correct_threshold),
            f"{VAL_PREFIX}response_length": statistics.fmean(response_lengths),
            f"{VAL_PREFIX}num_prompts": float(num_prompts),
        }
    )
    return metrics


def _accuracy(rewards: Sequence[float], threshold: float) -> float:
    return sum(r >= threshold for r in rewards) / len(rewards)


def split_evenly(count: int, parts: int) -> list[range]:
    """`count` positions as `parts` contiguous ranges whose sizes differ by at most one."""
    if parts < 1:
        raise ValueError(f"cannot split over {parts} parts")
    base, extra = divmod(count, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + base + (part < extra))
    return [range(start, end) for start, end in itertools.pairwise(bounds)]


class Evaluator:
    """Evaluates the policy held by the actors' rollout engines on a fixed held-out set."""

    def __init__(
        self,
        examples: Sequence[EvalExample],
        score_fn: ScoreFn,
        *,
        prompt_ids: Sequence[list[int]],
        tokenizer,
        spec: EvaluationSpec,
        max_response_length: int,
    ):
        """`prompt_ids[i]` are the token ids of `examples[i]`'s prompt, tokenized as the train prompts
        are (rldock.runtime.data.PromptDataset), so the policy sees held-out prompts in the same form."""
        if len(prompt_ids) != len(examples):
            raise ValueError(f"{len(prompt_ids)} tokenized prompts for {len(examples)} held-out examples")
        self.examples = list(examples)[: spec.max_prompts]
        if not self.examples:
            raise ValueError(
                "evaluation.interval > 0 but the held-out set has no prompts; give the job "
                "held-out prompts or set evaluation.interval to 0"
            )
        self.score_fn, self.tokenizer, self.spec = score_fn, tokenizer, spec
        self.max_response_length = max_response_length
        self.prompts = [list(ids) for ids in prompt_ids[: len(self.examples)]]  # the same prompts every evaluation

    def run(self, actors: Sequence, *, iteration: int) -> dict[str, float]:
        """Generate on the actors' engines, score and aggregate; returns the `val/...` metrics,
        with the evaluation's wall time as `val/seconds`. `actors` are ActorWorker handles, each
        with a rollout engine; `iteration` seeds sampled (non-greedy) evaluation."""
        started = time.perf_counter()
        chunks = split_evenly(len(self.prompts), len(actors))
        futures = [
            actor.evaluate.remote(self.request(chunk, iteration=iteration))
            for actor, chunk in zip(actors, chunks)
            if len(chunk)
        ]
        results = ray.get(futures)
        metrics = self.score(
            [samples for result in results for samples in result["responses"]],
            environment_rewards=[per for result in results for per in result.get("environment_rewards", [])] or None,
        )
        # multi-turn episodes: their turns and tool calls, as the rollout's (agent/episode_metrics.py)
        agent = agent_metrics([result["agent"] for result in results if "agent" in result])
        metrics.update({f"{VAL_PREFIX}agent/{key}": value for key, value in agent.get("agent", {}).items()})
        metrics[f"{VAL_PREFIX}seconds"] = time.perf_counter() - started
        logger.info(
            "evaluation after iteration %d: reward %.4f, accuracy %.4f on %d prompts",
            iteration,
            metrics[f"{VAL_PREFIX}reward"],
            metrics[f"{VAL_PREFIX}accuracy"],
            len(self.examples),
        )
        return metrics

    def request(self, indices: Sequence[int], *, iteration: int) -> HeldOutRequest:
        """What one actor rank is asked for the held-out prompts at `indices`."""
        return HeldOutRequest(
            prompts=[self.prompts[i] for i in indices],
            num_samples=self.spec.num_samples,
            greedy=self.spec.greedy,
            max_tokens=self.max_response_length,
            seed=iteration,
            prompt_keys=[EVAL_KEY_OFFSET + i for i in indices],
            contexts=[self._context(i) for i in indices],
            tasks=[self._task(i) for i in indices],
        )

    def _task(self, index: int) -> dict:
        """What a harness gets of held-out prompt `index` (rollout/harness.py's `task_of`; `prompt_index` is
        the prompt's place in the held-out set)."""
        example = self.examples[index]
        return {
            "prompt": example.prompt if example.row_prompt is None else example.row_prompt,
            "ground_truth": example.ground_truth,
            "data_source": example.data_source,
            "extra_info": example.extra_info,
            "prompt_index": index,
        }

    def _context(self, index: int) -> EpisodeContext:
        example = self.examples[index]
        return EpisodeContext(example.ground_truth, example.data_source, example.extra_info)

    def score(
        self,
        per_prompt: Sequence[Sequence[list[int]]],
        *,
        environment_rewards: Sequence[Sequence[list[float]]] | None = None,
    ) -> dict[str, float]:
        """The `val/...` metrics of generated responses: `per_prompt[i]` holds the response token
        id lists (EOS included when generated) of held-out prompt i; `environment_rewards[i]` (a job with
        an environment) each of those episodes' rewards per step, which an `environment` term scores."""
        if len(per_prompt) != len(self.examples):
            raise ValueError(f"responses for {len(per_prompt)} prompts, but {len(self.examples)} were evaluated")
        responses, examples, lengths = [], [], []
        for index, (example, samples) in enumerate(zip(self.examples, per_prompt)):
            for sample, tokens in enumerate(samples):
                responses.append(self._decode(tokens))
                scored = example
                if environment_rewards is not None:
                    trajectory = {"environment_rewards": environment_rewards[index][sample]}
                    scored = replace(example, extra_info={**example.extra_info, "trajectory": trajectory})
                examples.append(scored)
                lengths.append(len(tokens))
        rewards = self.score_fn(responses, examples)
        return aggregate(
            data_sources=[e.data_source for e in examples],
            rewards=rewards,
            response_lengths=lengths,
            num_prompts=len(self.examples),
            correct_threshold=self.spec.correct_threshold,
        )

    def _decode(self, tokens: list[int]) -> str:
        """The response text up to the first EOS, special tokens dropped (as the reward worker reads it)."""
        eos = self.tokenizer.eos_token_id
        if eos in tokens:
            tokens = tokens[: tokens.index(eos)]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


def val_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The `val/...` entries of a metrics record (empty on iterations that did not evaluate)."""
    return {key: value for key, value in record.items() if key.startswith(VAL_PREFIX)}
