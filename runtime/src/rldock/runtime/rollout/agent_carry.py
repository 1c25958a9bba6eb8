"""Carried episodes as a job's rollout (rollout.partial_rollout carry, an `agent` job on the native loop):
each actor rank keeps up to (dock.max_staleness + 1) batches of episode groups open on its engine
(rollout/carry.py's CarriedEpisodes, the bound and the cut), and each iteration writes the batch of groups
that finished; the others stay open, sessions and environment steps going on through the weight update,
and take their next turns on the newer weights.

What a rank does each iteration (one dock request of its replica's share, so that every rank writes its
own batch each iteration and no group misses its deadline on a rank the dock gave nothing):
- admits the prompt groups the dock hands it (while `admits_fresh`), and at its first iteration the
  driver's hand-ahead (`RolloutRequest.ahead`, one row per group, its replica's share): those fill its
  room, so the groups it starts are the ones the run's iterations write, no more;
- runs the open episodes until a batch can be written (carry.py's cut) and writes those groups into the
  rows it was handed: each group's rows take the group's own prompt columns (not the iteration's: the
  reward reads a row's answer in its `prompt_row`), its response columns, and its `policy_version`,
  the version that admitted it (the oldest of its tokens': the dock's staleness bound sees it), each token
  its own (`token_policy_version`) as with `resume`.

Counted per call (summed over ranks in the iteration's record, `rollout/carry_*`): episodes admitted,
written and left open after the cut. A checkpoint keeps no open episode: the ranks of a resumed attempt
start with none, and the driver draws the prompt groups of the episodes open when the checkpoint was taken
(its iteration's `rollout/carry_open`) again before any new prompt (driver/prompt_ledger.py), so their episodes are
generated anew on the checkpoint's weights: no group is lost, and none trains twice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence

import torch
from tensordict import TensorDict

from rldock.runtime.agent.episode_metrics import Sums, episode_sums, merged_sums
from rldock.runtime.data.row_column import rows_from_column
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageResult, run_stage
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.flow.columns import AGENT_PARTIAL_ROLLOUT, POLICY_VERSION, PROMPT_ROW
from rldock.runtime.rollout.agent import AgentRollout
from rldock.runtime.rollout.agent_episodes import AgentSampler, episode_columns
from rldock.runtime.rollout.carry import CarriedEpisodes, CarriedGroup, admits_fresh
from rldock.runtime.rollout.protocol import RolloutRequest, RolloutSetup, TimedWrites, decode_steps, unpadded

METRIC_KEYS = ("carry_admitted", "carry_written", "carry_open")


class CarriedAgentRollout(AgentRollout):
    """One actor rank's carried episodes: `generate` admits and writes as the module says; the old-logprob
    pass and the held-out evaluation are the agent rollout's."""

    def __init__(
        self,
        setup: RolloutSetup,
        sampler: AgentSampler,
        *,
        max_staleness: int,
        iterations: int,
        replica: int,
        seed: int,
    ):
        """`replica`: this rank's generation replica (its share of the hand-ahead); `seed`: the job's."""
        super().__init__(setup, sampler)
        self.max_staleness, self.iterations, self.replica, self.seed = max_staleness, iterations, replica, seed
        self.num_groups = setup.batch_size // setup.num_responses  # B: the groups of this rank's batch
        self.carried: CarriedEpisodes | None = None

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> StageResult:
        loop = self.sampler.loop_on(engine)
        first = self.carried is None
        if self.carried is None:
            self.carried = CarriedEpisodes(
                loop, num_groups=self.num_groups, max_staleness=self.max_staleness, seed=self.seed
            )
        carried = self.carried
        assert carried.loop is loop, "a rank's engine stays the same for the whole attempt"
        admitted_before, written_before = carried.counts.started, carried.counts.written
        writes = TimedWrites(dock)
        sums: list[Sums] = []
        lengths: list[int] = []

        def rollout(indices: torch.Tensor, batch: TensorDict) -> None:
            group = self.setup.num_responses
            if admits_fresh(
                request.iteration, first=first, iterations=self.iterations, max_staleness=self.max_staleness
            ):
                slots = indices[::group] // group  # (B,) the groups' slots in the bank
                batch_number = request.iteration if first else request.iteration + self.max_staleness
                self._admit(batch[::group], slots + batch_number * self.setup.num_prompts_per_iteration, request)
            if first and request.ahead is not None:
                share, numbers = ahead_share(
                    request.ahead,
                    replica=self.replica,
                    num_groups=self.num_groups,
                    groups_per_batch=self.setup.num_prompts_per_iteration,
                )
                first_ahead = (request.iteration + 1) * self.setup.num_prompts_per_iteration
                self._admit(share, numbers + first_ahead, request)
            written = carried.next_batch(version=request.policy_version)
            episodes = [episode for g in written for episode in g.episodes]
            columns = episode_columns(
                episodes,
                max_response_length=self.setup.max_response_length,
                max_turns=self.sampler.spec.max_turns,
                pad_token_id=self.setup.pad_token_id,
                policy_version=request.policy_version,
                engine_columns=AGENT_PARTIAL_ROLLOUT,
            )
            for version, rows, out in carried_rows(written, indices, columns, group=group):
                writes.put(rows, out, policy_version=version)
            sums.append(episode_sums(episodes, loop))
            lengths.extend(len(episode.response) for episode in episodes)

        timing = run_stage(
            dock,
            self.setup.spec,
            rollout,
            rank=self.setup.rank,
            batch_size=self.setup.batch_size,
            whole_groups=True,
            max_batches=1,  # exactly this rank's batch: each rank writes one batch per iteration
            policy_version=request.policy_version,
        )
        timing.compute_s -= writes.seconds
        timing.dispatch_s += writes.seconds
        metrics: dict = {
            "decode_steps": decode_steps(lengths),
            "carry_admitted": carried.counts.started - admitted_before,
            "carry_written": carried.counts.written - written_before,
            "carry_open": carried.open_episodes,
        }
        if sums:
            metrics["agent"] = merged_sums(sums)
        return timing.with_metrics(**metrics)

    def _admit(self, prompts: TensorDict, numbers: torch.Tensor, request: RolloutRequest) -> None:
        """Admit one group per row of `prompts` (the group's prompt columns), group `numbers` (k,) counted
        over the run (a batch's groups, then the next batch's): its episodes are keyed by number x N + j,
        new to the run whichever rank admits them."""
        group = self.setup.num_responses
        assert self.carried is not None
        self.carried.admit(
            unpadded(prompts["prompt_ids"], prompts["prompt_mask"]),
            keys=[[number * group + j for j in range(group)] for number in numbers.tolist()],
            contexts=[self.sampler.context(row) for row in rows_from_column(prompts[PROMPT_ROW[0]])],
            version=request.policy_version,
            tags=[prompts[i] for i in range(len(prompts))],
        )


def ahead_share(
    ahead: TensorDict, *, replica: int, num_groups: int, groups_per_batch: int
) -> tuple[TensorDict, torch.Tensor]:
    """Replica `replica`'s share of the driver's hand-ahead `ahead` (one row per group, `groups_per_batch`
    (G) rows per batch, batch after batch): its `num_groups` groups of each batch, and their numbers (k,)
    within `ahead`."""
    total = len(ahead)
    if total % groups_per_batch or groups_per_batch % num_groups:
        raise ValueError(
            f"{total} groups handed ahead do not split into batches of {groups_per_batch} in shares of {num_groups}"
        )
    numbers = torch.tensor(
        [start + replica * num_groups + k for start in range(0, total, groups_per_batch) for k in range(num_groups)],
        dtype=torch.int64,
    )  # (k,)
    return ahead[numbers], numbers


def carried_rows(
    written: Sequence[CarriedGroup], indices: torch.Tensor, responses: TensorDict, *, group: int
) -> Iterator[tuple[int, torch.Tensor, TensorDict]]:
    """The dock writes of a carried batch: `written` groups into the rank's rows `indices` (B*N,) in order,
    `responses` their episodes' columns (B*N rows) with each group's own prompt columns (its
    `CarriedGroup.prompt`, one row) on its N rows and its admission's version as `policy_version`; one
    (version, rows, columns) per version, since a dock write tags its rows with one."""
    versions = torch.tensor([g.version for g in written], dtype=torch.int64).repeat_interleave(group)  # (B*N,)
    columns = responses.clone()
    for name in written[0].prompt.keys():  # each (B*N, ...): a group's row on its N rows
        columns[name] = torch.stack([g.prompt[name] for g in written]).repeat_interleave(group, dim=0)
    columns[POLICY_VERSION[0]] = versions
    by_version: dict[int, list[int]] = defaultdict(list)
    for row, version in enumerate(versions.tolist()):
        by_version[version].append(row)
    for version, rows in sorted(by_version.items()):
        picked = torch.tensor(rows, dtype=torch.int64)
        yield version, indices[picked], columns[picked]
