"""The reward of a batch: every configured term scored, weighted and summed, with its metrics.

Metrics per batch: `reward/<term>` is a term's mean score (a name used by two terms gets the
term's index: `reward/format_0`, `reward/format_2`), `reward/<term>/<key>` the mean of each other
numeric key a term's dicts returned, and `reward/errors` the number of (term, sample) pairs that
raised and scored 0 under `reward.on_error: zero`.

A term whose scores were computed elsewhere (the `model` term: the reward_model worker state
writes them to the dock) gets them through `score(..., precomputed={term index: (B,) scores})`;
they are weighted and reported like any other term's.

A return value of the wrong kind (not a number, a dict without a numeric "score", NaN) always
fails, whatever `on_error` says: it comes from the function's code, not from one sample, and
would silently zero every sample.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rldock.config.reward import RewardSpec, RewardTermSpec
from rldock.runtime.rewards.terms import REWARDS, BatchRewardFn, RewardBatch, RewardError

logger = logging.getLogger(__name__)

ERRORS_METRIC = "reward/errors"


@dataclass
class ScoredBatch:
    scores: torch.Tensor  # (B,) float32: sum over terms of weight * score, unshaped
    term_scores: dict[str, torch.Tensor]  # term label -> (B,) float32, unweighted
    extras: dict[str, list[float]]  # "reward/<term>/<key>" -> values of the samples that returned the key
    num_errors: int  # (term, sample) pairs scored 0 by on_error: zero

    @property
    def metrics(self) -> dict[str, float]:
        means = {f"reward/{label}": scores.mean().item() for label, scores in self.term_scores.items()}
        means.update({key: sum(values) / len(values) for key, values in self.extras.items()})
        return {**means, ERRORS_METRIC: float(self.num_errors)}


@dataclass
class _Term:
    label: str  # metric name under reward/
    description: str  # for messages: "reward.terms[1] (function rewards.py:score)"
    weight: float
    score_batch: BatchRewardFn


def _describe(term: RewardTermSpec, at: str) -> str:
    detail = term.function or term.url or term.pattern or term.path
    return f"{at} ({term.name} {detail})" if detail else f"{at} ({term.name})"


class RewardScorer:
    """Builds every term of `spec` once (loading functions, checking tokens; a bad term raises
    RewardError naming its field) and scores batches with them."""

    def __init__(self, spec: RewardSpec):
        self.on_error = spec.on_error
        counts = Counter(term.name for term in spec.terms)
        self.terms = []
        for index, term in enumerate(spec.terms):
            at = f"reward.terms[{index}]"
            label = term.name if counts[term.name] == 1 else f"{term.name}_{index}"
            build = REWARDS.get(term.name)
            self.terms.append(_Term(label, _describe(term, at), term.weight, build(term, at)))

    def score(
        self,
        responses: list[str],
        ground_truths: list[str],
        data_sources: list[str],
        extra_infos: list[dict],
        *,
        prompts: list[str | list] | None = None,
        columns: Mapping[str, list] | None = None,
        completion_ids: list[list[int]] | None = None,
        precomputed: Mapping[int, torch.Tensor] | None = None,
    ) -> ScoredBatch:
        """Score a batch; `prompts` (each row's prompt as stored), `columns` (each other data column's
        values) and `completion_ids` are what TRL-form functions read besides the responses (RewardBatch);
        `precomputed` maps a term's index in reward.terms to its (B,) scores, computed elsewhere (the
        `model` term's rm_score), used instead of calling the term."""
        num = len(responses)
        if not len(ground_truths) == len(data_sources) == len(extra_infos) == num:
            raise ValueError(
                f"{num} responses but {len(ground_truths)} ground truths, {len(data_sources)} "
                f"data sources and {len(extra_infos)} extra infos"
            )
        precomputed = precomputed or {}
        # the reward worker passes the `model` term's index (RewardSpec.model_term_index)
        assert set(precomputed) <= set(range(len(self.terms))), f"scores of terms {sorted(precomputed)}"
        batch = RewardBatch(
            data_sources, responses, ground_truths, extra_infos, prompts, dict(columns or {}), completion_ids
        )
        total = torch.zeros(num, dtype=torch.float32)  # (B,)
        term_scores: dict[str, torch.Tensor] = {}
        extras: dict[str, list[float]] = {}
        num_errors = 0
        for index, term in enumerate(self.terms):
            if index in precomputed:
                scores = _checked_scores(precomputed[index], term, num)  # (B,)
                term_scores[term.label] = scores
                total += term.weight * scores
                continue
            outcomes = term.score_batch(batch)
            if len(outcomes) != num:
                raise RewardError(f"{term.description} returned {len(outcomes)} scores for {num} samples")
            values, failed = [], []
            for index, outcome in enumerate(outcomes):
                if isinstance(outcome, Exception):
                    if self.on_error == "fail":
                        raise RewardError(
                            f"{term.description} failed on a sample from data_source {data_sources[index]!r}: "
                            f"{type(outcome).__name__}: {outcome} (reward.on_error: zero would score it 0)"
                        ) from outcome
                    failed.append(outcome)
                    values.append(0.0)
                    continue
                score, metrics = _parse_value(outcome, term)
                values.append(score)
                for key, value in metrics.items():
                    extras.setdefault(f"reward/{term.label}/{key}", []).append(value)
            if failed:
                logger.warning(
                    "%s raised on %d of %d samples, scored 0 (reward.on_error: zero); first: %s: %s",
                    term.description,
                    len(failed),
                    num,
                    type(failed[0]).__name__,
                    failed[0],
                )
            num_errors += len(failed)
            scores = torch.tensor(values, dtype=torch.float32)  # (B,)
            term_scores[term.label] = scores
            total += term.weight * scores
        return ScoredBatch(total, term_scores, extras, num_errors)


def _checked_scores(scores: torch.Tensor, term: _Term, num: int) -> torch.Tensor:
    """Precomputed scores as (B,) float32 on the CPU; a wrong shape or a NaN/inf is an error."""
    scores = scores.detach().to("cpu", torch.float32)
    if scores.shape != (num,):
        raise RewardError(f"{term.description} got precomputed scores of shape {tuple(scores.shape)} for {num} samples")
    if not torch.isfinite(scores).all():
        raise RewardError(f"{term.description} got non-finite precomputed scores: {scores.tolist()}")
    return scores


def _number(value: Any) -> float | None:
    """`value` as a finite float, or None if it is not a real number."""
    if isinstance(value, (bool, int, float)) or (hasattr(value, "item") and getattr(value, "ndim", 1) == 0):
        number = float(value)
        return number if math.isfinite(number) else None
    return None


def _parse_value(outcome: Any, term: _Term) -> tuple[float, dict[str, float]]:
    """(score, other numeric keys) of what a reward function returned."""
    if isinstance(outcome, dict):
        score = _number(outcome.get("score"))
        if score is None:
            raise RewardError(
                f'{term.description} returned a dict whose "score" is {outcome.get("score")!r}; '
                'it must hold a finite number under "score"'
            )
        # Other keys that are numbers become metrics; the rest (a parsed answer, a message) is dropped.
        metrics = {
            key: number for key, value in outcome.items() if key != "score" and (number := _number(value)) is not None
        }
        return score, metrics
    score = _number(outcome)
    if score is None:
        raise RewardError(
            f"{term.description} returned {type(outcome).__name__} {outcome!r:.100}; a reward "
            'returns a finite number or a dict with a numeric "score"'
        )
    return score, {}
