"""What the driver puts into the dock each iteration: prompt groups, preference pairs, or (DAPO's
dynamic sampling) groups over several sampling rounds until G of them have scores that differ.

The batch builders are pure (prompt dataset, sampled positions, tokenizer -> TensorDict); `DynamicSampling`
runs the rounds through callables the trainer passes, so it holds no worker or dock itself.
Nothing here survives an iteration: a resumed run redoes the iteration from the sampler position
saved with the checkpoint, and rollout seeds depend on (iteration, round, group) only, so it draws
and keeps the same groups again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime.algorithms.episode_rows import episode_heads
from rldock.runtime.data import PromptDataset
from rldock.runtime.data.row_column import padded_rows
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.flow.columns import EPISODE, PROMPT_DRAW, PROMPT_ROW
from rldock.runtime.models.loading import encode_answers, pad_prompts
from rldock.runtime.registry import Registry


@dataclass
class DriverBatch:
    batch: TensorDict  # (B,) rows, groups consecutive
    prompt_lengths: list[int]  # tokens of each distinct prompt (one per group)


BatchBuilder = Callable[..., DriverBatch]
BATCH_BUILDERS: Registry[BatchBuilder] = Registry("driver batch", field="algorithm.name")


@BATCH_BUILDERS.register("prompt_groups")
def prompt_groups(
    dataset: PromptDataset, positions: Sequence[int], tokenizer, algo: AlgorithmSpec, *, rows_per_episode: int = 1
) -> DriverBatch:
    """Each prompt N*S times (S rows per sample: a harness's segments, else 1) with its train-file row, by
    number and whole: (G*N*S,) rows."""
    prompt_ids, prompt_mask = pad_prompts(dataset.prompt_ids(positions), algo.max_prompt_length, tokenizer.pad_token_id)
    prompt_index = torch.tensor([dataset.prompt_index(p) for p in positions], dtype=torch.int64)  # (G,)
    width = dataset.row_width
    encoded = padded_rows(dataset.encoded_rows(positions), width)
    prompt_row = (  # (G, W); frombuffer takes no empty buffer
        torch.frombuffer(encoded, dtype=torch.uint8).view(len(positions), width)
        if encoded
        else torch.zeros((0, width), dtype=torch.uint8)
    )
    n = algo.num_responses_per_prompt * rows_per_episode
    batch = TensorDict(
        {
            "prompt_ids": prompt_ids.repeat_interleave(n, dim=0),  # (G*N*S, PL)
            "prompt_mask": prompt_mask.repeat_interleave(n, dim=0),
            "prompt_index": prompt_index.repeat_interleave(n, dim=0),  # (G*N*S,)
            PROMPT_ROW[0]: prompt_row.repeat_interleave(n, dim=0),  # (G*N*S, W)
        },
        batch_size=[len(positions) * n],
    )
    return DriverBatch(batch, prompt_mask.sum(dim=1).tolist())


@BATCH_BUILDERS.register("preference_pairs")
def preference_pairs(
    dataset: PromptDataset, positions: Sequence[int], tokenizer, algo: AlgorithmSpec, *, rows_per_episode: int = 1
) -> DriverBatch:
    """DPO pairs as finished responses: rows 2i (chosen) and 2i+1 (rejected) share prompt i; each
    response is its answer tokens then EOS, as the policy would have to write it: (2G,) rows
    (`rows_per_episode` is 1: no harness)."""
    assert rows_per_episode == 1, "the config checks give DPO no harness"
    pairs = dataset.preference_pairs(positions)
    prompt_ids, prompt_mask = pad_prompts(dataset.prompt_ids(positions), algo.max_prompt_length, tokenizer.pad_token_id)
    texts = [text for p in pairs for text in (p.chosen, p.rejected)]
    response_ids, response_mask = encode_answers(tokenizer, texts, algo.max_response_length - 1)
    lengths = response_mask.sum(dim=1)  # (2G,)
    pad = torch.full((len(texts), 1), tokenizer.pad_token_id, dtype=response_ids.dtype)
    response_ids = torch.cat([response_ids, pad], dim=1)  # (2G, SL)
    response_ids[torch.arange(len(texts)), lengths] = tokenizer.eos_token_id
    response_mask = torch.cat([response_mask, torch.zeros_like(pad)], dim=1)
    response_mask[torch.arange(len(texts)), lengths] = 1
    batch = TensorDict(
        {
            "prompt_ids": prompt_ids.repeat_interleave(2, dim=0),  # (2G, PL)
            "prompt_mask": prompt_mask.repeat_interleave(2, dim=0),
            "response_ids": response_ids,  # (2G, SL)
            "response_mask": response_mask,
            "response_length": lengths + 1,  # (2G,) the answer and its EOS
        },
        batch_size=[len(texts)],
    )
    return DriverBatch(batch, prompt_mask.sum(dim=1).tolist())


class Feed:
    """What the driver draws each iteration: the recipe's batch (`algorithm` + `driver_batch`, a
    name in BATCH_BUILDERS) of the next prompts in the seeded sampler's order, each row tagged with
    its group's draw number (`prompt_draw`, the prompt ledger's name for the group: prompt_ledger.py).
    Lives as long as the job; a checkpoint keeps its position (`state_dict`) and a resumed attempt
    loads it, then `requeue`s the groups drawn before it that never trained."""

    def __init__(
        self,
        dataset: PromptDataset,
        sampler,
        tokenizer,
        algo: AlgorithmSpec,
        driver_batch: str,
        *,
        rows_per_episode: int = 1,
    ):
        """`rows_per_episode`: JobConfig.rows_per_episode, each sample's dock rows."""
        self.dataset, self.sampler, self.tokenizer, self.algo = dataset, sampler, tokenizer, algo
        self.build = BATCH_BUILDERS.get(driver_batch)
        self.rows_per_episode = rows_per_episode
        self.requeued: list[int] = []  # draw numbers drawn again before any new one

    def draw(self, num_prompts: int | None = None) -> DriverBatch:
        """The batch of the next `num_prompts` prompts (default G): requeued groups first."""
        count = self.algo.num_prompts_per_iteration if num_prompts is None else num_prompts
        again, self.requeued = self.requeued[:count], self.requeued[count:]
        first_new = self.sampler.drawn
        positions = [self.sampler.prompt_of(d) for d in again] + self.sampler.next_batch(count - len(again))
        draws = torch.tensor(again + list(range(first_new, self.sampler.drawn)), dtype=torch.int64)  # (count,)
        fed = self.build(self.dataset, positions, self.tokenizer, self.algo, rows_per_episode=self.rows_per_episode)
        rows_per_group = len(fed.batch) // count if count else 0
        fed.batch[PROMPT_DRAW[0]] = draws.repeat_interleave(rows_per_group)  # (count * rows per group,)
        return fed

    def requeue(self, draws: Sequence[int]) -> None:
        """Draw the groups numbered `draws` (drawn before, by a run this one resumes) before any new one;
        replaces what was requeued before."""
        self.requeued = sorted(draws)

    @property
    def drawn(self) -> int:
        """The groups drawn so far, requeued ones not yet drawn again among them: the next new draw's number."""
        return self.sampler.drawn

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


def merge_rounds(rounds: Sequence[Sequence[StageResult]]) -> list[StageResult]:
    """One stage's per-worker results of several rounds -> one per worker: seconds and samples
    summed, and metrics too (numbers summed, lists concatenated, dicts merged the same way key by
    key: the reward worker's metric sums and counts) (workers in the same order every round)."""
    merged = []
    for per_worker in zip(*rounds):
        out = StageResult()
        for result in per_worker:
            out.wait_s += result.wait_s
            out.dispatch_s += result.dispatch_s
            out.compute_s += result.compute_s
            out.num_samples += result.num_samples
            _merge_into(out.metrics, result.metrics)
        merged.append(out)
    return merged


def _merge_into(out: dict, result: dict) -> None:
    for key, value in result.items():
        if isinstance(value, dict):
            _merge_into(out.setdefault(key, {}), value)
        elif key in out:
            out[key] = out[key] + value
        else:
            out[key] = list(value) if isinstance(value, list) else value


def group_rows(groups: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dock rows (sample indices) of group slots `groups` (k,) -> (k*N,), groups consecutive."""
    return (groups[:, None] * group_size + torch.arange(group_size)).reshape(-1)


@dataclass
class SampleFacts:
    """What the driver reads of each sample through the recipe's sample_facts state (flow/states.py): the
    reward before shaping (`score`; none in a recipe without a reward state) and the response's
    tokens, and the prompt groups they belong to. The iteration's record takes reward_mean/std and
    response_length_mean from them, the prompt ledger the groups; with DAPO's sampling rounds they hold
    every round's samples, the dropped groups' too."""

    scores: list[float] = field(default_factory=list)
    response_lengths: list[int] = field(default_factory=list)
    draws: set[int] = field(default_factory=set)  # the prompt groups of the samples read, by draw number

    def add(self, read: TensorDict) -> None:
        """Add the facts of a read of the sample_facts state (its (B,) columns): where an episode is several
        rows (`episode`: a harness's segments) its reward once and the lengths of its segments, not of
        its empty rows."""
        self.draws.update(read[PROMPT_DRAW[0]].tolist())
        lengths = read["response_length"]  # (B,)
        if EPISODE[0] in read.keys():
            heads = episode_heads(read[EPISODE[0]])  # (B,)
            if "score" in read.keys():
                self.scores.extend(read["score"][heads].tolist())
            self.response_lengths.extend(lengths[heads | (lengths > 0)].tolist())
            return
        if "score" in read.keys():
            self.scores.extend(read["score"].tolist())
        self.response_lengths.extend(lengths.tolist())


@dataclass
class SampledRounds:
    batch: DriverBatch  # what the driver put in each of the G group slots, as it stands in the dock
    results: dict[str, list[StageResult]]  # per sampling state: its workers' results summed over rounds
    metrics: dict[str, float]
    facts: SampleFacts | None = None  # every round's, as the filter read them (None: not read yet)


# (group slots (k,) ascending, fresh prompt groups for them (k*N*S rows), round index) -> (results of
# the sampling states per state, the filter's score of their episodes (k*N,) in slot order)
RunRound = Callable[[torch.Tensor, DriverBatch, int], tuple[dict[str, list[StageResult]], torch.Tensor]]


class DynamicSampling:
    """Sampling rounds until `num_groups` groups pass `group_filter` (DAPO, arXiv 2503.14476 sec. 3.2).

    The dock holds G group slots. Round 0 fills all of them; each later round `draw(k)`s fresh
    prompt groups only for the k slots whose group the filter dropped, and `run_round` empties those
    slots in the dock, puts the fresh groups there, runs the sampling states and returns the
    groups' scores. Kept groups never leave the dock and no sample column passes the driver, only
    the (B,) scores. If `max_rounds` leave some slots without a kept group, the last round's dropped
    groups stay there (advantage 0: they add no gradient, only tokens to the mean) and
    `dynamic_sampling/padded_groups` says how many.
    """

    def __init__(
        self,
        *,
        num_groups: int,
        group_size: int,
        max_rounds: int,
        group_filter: Callable[[torch.Tensor, int], torch.Tensor],
        episodes_per_group: int | None = None,
    ):
        """`group_size`: a group's dock rows (N*S); `episodes_per_group`: its episodes (N; default
        `group_size`), what `run_round`'s scores and the filter count."""
        assert max_rounds >= 1, "the config bounds algorithm.dapo.max_sampling_rounds below by 1"
        self.num_groups, self.group_size, self.max_rounds = num_groups, group_size, max_rounds
        self.episodes_per_group = group_size if episodes_per_group is None else episodes_per_group
        self.group_filter = group_filter

    def run(self, draw: Callable[[int], DriverBatch], run_round: RunRound) -> SampledRounds:
        n = self.group_size
        kept = torch.zeros(self.num_groups, dtype=torch.bool)  # (G,)
        prompt_lengths = [0] * self.num_groups
        slots_batch: TensorDict | None = None  # (G*N,) what the driver put, slot by slot
        results: list[dict[str, list[StageResult]]] = []
        rounds = 0
        while rounds < self.max_rounds and not kept.all():
            empty = torch.nonzero(~kept).flatten()  # (k,) ascending
            fresh = draw(len(empty))
            stage_results, scores = run_round(empty, fresh, rounds)
            results.append(stage_results)
            kept[empty[self.group_filter(scores, self.episodes_per_group)]] = True
            if slots_batch is None:
                slots_batch = fresh.batch.clone()
            else:
                slots_batch[group_rows(empty, n)] = fresh.batch
            for slot, length in zip(empty.tolist(), fresh.prompt_lengths):
                prompt_lengths[slot] = length
            rounds += 1
        num_kept = int(kept.sum())
        assert slots_batch is not None  # max_rounds >= 1 and the first round fills every slot
        metrics: dict[str, float] = {
            "dynamic_sampling/rounds": rounds,
            "dynamic_sampling/kept_groups": num_kept,
            "dynamic_sampling/padded_groups": self.num_groups - num_kept,
        }
        merged = {state: merge_rounds([r[state] for r in results]) for state in results[0]}
        return SampledRounds(DriverBatch(slots_batch, prompt_lengths), merged, metrics)
