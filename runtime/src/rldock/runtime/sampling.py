"""What the driver puts into the dock each iteration: prompt groups, preference pairs, or (DAPO's
dynamic sampling) only the groups of several sampling rounds whose rewards differ.

The batch builders are pure (task, prompt indexes, tokenizer -> TensorDict); `DynamicSampling`
runs the rounds through callables the trainer passes, so it holds no worker or dock itself.
Nothing here survives an iteration: a resumed run redoes the iteration from the sampler position
saved with the checkpoint, and rollout seeds depend on (iteration, round, group) only, so it draws
and keeps the same groups again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from tensordict import TensorDict

from rldock.config.job import AlgorithmSpec
from rldock.runtime.models.loading import encode_answers, encode_prompts
from rldock.runtime.registry import Registry


@dataclass
class DriverBatch:
    batch: TensorDict  # (B,) rows, groups consecutive
    prompt_lengths: list[int]  # tokens of each distinct prompt (one per group)
    response_lengths: list[int] = field(default_factory=list)  # set when the driver supplies responses


BatchBuilder = Callable[..., DriverBatch]
BATCH_BUILDERS: Registry[BatchBuilder] = Registry("driver batch", field="algorithm.name")


@BATCH_BUILDERS.register("prompt_groups")
def prompt_groups(task, indices: Sequence[int], tokenizer, algo: AlgorithmSpec) -> DriverBatch:
    """Each prompt N times (one row per sample) with its reference answer: (G*N,) rows."""
    items = task.examples(indices)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [e.prompt for e in items], algo.max_prompt_length)
    answer_ids, answer_mask = encode_answers(tokenizer, [e.answer for e in items], algo.max_response_length)
    n = algo.num_responses_per_prompt
    batch = TensorDict({
        "prompt_ids": prompt_ids.repeat_interleave(n, dim=0),  # (G*N, PL)
        "prompt_mask": prompt_mask.repeat_interleave(n, dim=0),
        "answer_ids": answer_ids.repeat_interleave(n, dim=0),  # (G*N, A)
        "answer_mask": answer_mask.repeat_interleave(n, dim=0),
    }, batch_size=[len(items) * n])
    return DriverBatch(batch, prompt_mask.sum(dim=1).tolist())


@BATCH_BUILDERS.register("preference_pairs")
def preference_pairs(task, indices: Sequence[int], tokenizer, algo: AlgorithmSpec) -> DriverBatch:
    """DPO pairs as finished responses: rows 2i (chosen) and 2i+1 (rejected) share prompt i; each
    response is its answer tokens then EOS, as the policy would have to write it: (2G,) rows."""
    pairs = task.preference_pairs(indices)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [p.prompt for p in pairs], algo.max_prompt_length)
    texts = [text for p in pairs for text in (p.chosen, p.rejected)]
    response_ids, response_mask = encode_answers(tokenizer, texts, algo.max_response_length - 1)
    lengths = response_mask.sum(dim=1)  # (2G,)
    pad = torch.full((len(texts), 1), tokenizer.pad_token_id, dtype=response_ids.dtype)
    response_ids = torch.cat([response_ids, pad], dim=1)  # (2G, SL)
    response_ids[torch.arange(len(texts)), lengths] = tokenizer.eos_token_id
    response_mask = torch.cat([response_mask, torch.zeros_like(pad)], dim=1)
    response_mask[torch.arange(len(texts)), lengths] = 1
    batch = TensorDict({
        "prompt_ids": prompt_ids.repeat_interleave(2, dim=0),  # (2G, PL)
        "prompt_mask": prompt_mask.repeat_interleave(2, dim=0),
        "response_ids": response_ids,  # (2G, SL)
        "response_mask": response_mask,
    }, batch_size=[len(texts)])
    return DriverBatch(batch, prompt_mask.sum(dim=1).tolist(), (lengths + 1).tolist())


def merge_rounds(rounds: Sequence[Sequence[dict]]) -> list[dict]:
    """One stage's per-worker result dicts of several rounds -> one dict per worker: numbers summed,
    lists concatenated (workers in the same order every round)."""
    merged = []
    for per_worker in zip(*rounds):
        out: dict = {}
        for result in per_worker:
            for key, value in result.items():
                out[key] = out[key] + value if key in out else (list(value) if isinstance(value, list) else value)
        merged.append(out)
    return merged


def pick_groups(batch: TensorDict, keep: torch.Tensor, group_size: int) -> TensorDict:
    """Rows of the groups where keep (num_groups,) is True, groups kept whole and in order."""
    rows = keep.repeat_interleave(group_size)  # (B,)
    return batch[rows]


@dataclass
class SampledRounds:
    batch: DriverBatch  # exactly G groups for the remaining states
    results: dict[str, list[dict]]  # per sampling state: its workers' results summed over rounds
    metrics: dict[str, float]


class DynamicSampling:
    """Sampling rounds until `num_groups` groups pass `group_filter` (DAPO, arXiv 2503.14476 sec. 3.2).

    Each round calls `draw()` for a fresh DriverBatch of G prompt groups and `run_round(batch,
    round_index)` to put it, run the sampling states and return (their results, the scored batch
    read back from the dock). Groups beyond G are discarded (they would be stale next iteration);
    if `max_rounds` leave the batch short, dropped groups (advantage 0: they add no gradient, only
    tokens to the mean) fill it and `dynamic_sampling/padded_groups` says how many.
    """

    def __init__(self, *, num_groups: int, group_size: int, max_rounds: int,
                 group_filter: Callable[[torch.Tensor, int], torch.Tensor]):
        self.num_groups, self.group_size, self.max_rounds = num_groups, group_size, max_rounds
        self.group_filter = group_filter

    def run(self, draw: Callable[[], DriverBatch],
            run_round: Callable[[DriverBatch, int], tuple[dict[str, list[dict]], TensorDict]]) -> SampledRounds:
        kept: list[TensorDict] = []
        dropped: list[TensorDict] = []
        results: list[dict[str, list[dict]]] = []
        num_kept = rounds = 0
        while num_kept < self.num_groups and rounds < self.max_rounds:
            fresh = draw()
            stage_results, scored = run_round(fresh, rounds)
            results.append(stage_results)
            keep = self.group_filter(scored["reward"], self.group_size)  # (G,)
            kept.append(pick_groups(scored, keep, self.group_size))
            dropped.append(pick_groups(scored, ~keep, self.group_size))
            num_kept += int(keep.sum())
            rounds += 1
        padded = max(0, self.num_groups - num_kept)
        batch = torch.cat([*kept, *dropped])[: self.num_groups * self.group_size]  # (G*N,)
        prompt_lengths = batch["prompt_mask"][:: self.group_size].sum(dim=1).tolist()
        metrics = {"dynamic_sampling/rounds": rounds, "dynamic_sampling/kept_groups": num_kept,
                   "dynamic_sampling/padded_groups": padded}
        merged = {state: merge_rounds([r[state] for r in results]) for state in results[0]}
        return SampledRounds(DriverBatch(batch, prompt_lengths), merged, metrics)
