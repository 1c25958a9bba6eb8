"""Carried episodes: an iteration's batch is filled with the episode groups that have finished, and the
unfinished ones are carried, sessions open, into the next iterations, where they finish on newer weights.

Why: when episode lengths have a heavy tail (an environment whose steps take 1-10x each other), an
iteration that waits for all its episodes waits for its slowest one, and the engine and the trainer idle
meanwhile. Here the rank keeps more groups open than one batch and writes the first to finish.

The bound. A group admitted while the policy is at version u must train at version u + max_staleness at
the latest: that is its deadline. With B the groups of a batch:
- admission: at most (max_staleness + 1) * B groups are open at once (as AReaL bounds its rollouts,
  arXiv 2505.24298: never more started than the next max_staleness + 1 batches take), so every group
  admitted can meet its deadline;
- the cut (`batch_of`): the batch at version v is B finished groups such that every later batch can
  still take the groups due by then: for every deadline d >= v, the groups due by d that stay open are
  at most (d - v) * B. The groups due at v itself are therefore always in it (the batch waits for them);
  past what the bound needs, the last admitted finished groups go first, so a group that finished fast
  trains fresh and the slow ones use the bound.
So no group is dropped for staleness and none trains older than max_staleness versions (staleness: the
version that trains it less the version that admitted it). With max_staleness 0 a batch is exactly the
groups admitted for it, run to their ends: the synchronous iteration.
With admission full, as many groups fall due at each version as a batch holds, so after the first
max_staleness batches each batch is exactly the groups admitted max_staleness versions before it.

A group is N episodes of one prompt (algorithm.num_responses_per_prompt): the advantage normalises over
the group, so it is written whole, once all N have ended.

Admission in a job (rollout.partial_rollout carry, rollout/agent_carry.py): the driver puts each iteration's
prompt groups into its dock bank as always, and a rank admits the ones it takes; to fill its room at the
first iteration of a run (or of a resumed attempt) the driver hands it the prompts of the next
`batches_ahead` batches too. Later iterations admit their own groups only while the batch they fill (the
room's newest, iteration + max_staleness) is one the run reaches (`admits_fresh`), so the last batches drain
the open groups and every group admitted is written by the run's end. `python -m rldock_benchmarks.heavy_tail`
runs the same class on an engine with its own prompts.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rldock.runtime.agent.episode_loop import AgentLoop, Episode, Rollout
from rldock.runtime.agent.interfaces import EpisodeContext


@dataclass(frozen=True)
class CarriedGroup:
    """The episodes of one prompt, admitted at `version`, due at `deadline`; `order`: its admission's;
    `prompt`: what the caller needs to write the group (a job's rollout: the group's prompt columns)."""

    episodes: tuple[Episode, ...]
    version: int
    deadline: int
    order: int
    prompt: Any = None

    @property
    def finished(self) -> bool:
        return all(episode.finished for episode in self.episodes)


def admission_room(num_open: int, *, num_groups: int, max_staleness: int) -> int:
    """Groups that may be admitted with `num_open` open: up to (max_staleness + 1) * `num_groups`."""
    return max((max_staleness + 1) * num_groups - num_open, 0)


def batches_ahead(iteration: int, *, iterations: int, max_staleness: int) -> int:
    """Batches of prompt groups beyond `iteration`'s own that a rank admits when a run of `iterations`
    (or an attempt resumed there) starts at `iteration`: enough to fill its room, none past the last."""
    return max(min(max_staleness, iterations - iteration), 0)


def admits_fresh(iteration: int, *, first: bool, iterations: int, max_staleness: int) -> bool:
    """Whether a rank admits `iteration`'s own prompt groups: at the first iteration it runs (with
    `batches_ahead` more), and later while the batch they fill, iteration + max_staleness, is one the run of
    `iterations` reaches. So a rank that starts at i0 admits (iterations - i0 + 1) batches in all: as many
    as it writes."""
    return first or iteration + max_staleness <= iterations


def batch_of(groups: Sequence[CarriedGroup], *, version: int, num_groups: int) -> list[CarriedGroup] | None:
    """The `num_groups` finished groups the batch at `version` is written with, or None while none can be
    yet. First the groups the bound needs now (the module docstring's cut: for each deadline d, those due by
    d that the batches after this one cannot take, the earliest deadlines first), then the other finished
    groups, the last admitted first: each goes as fresh as it finished."""
    finished = [g for g in groups if g.finished]
    if len(finished) < num_groups:
        return None
    earliest = sorted(finished, key=lambda g: (g.deadline, g.order))
    due = Counter(g.deadline for g in groups)
    chosen: list[CarriedGroup] = []
    due_by = 0  # groups due by `deadline`
    for deadline in sorted(due):
        due_by += due[deadline]
        while (
            earliest
            and earliest[0].deadline <= deadline
            and (due_by - len(chosen) > max(deadline - version, 0) * num_groups)
        ):
            chosen.append(earliest.pop(0))
        if due_by - len(chosen) > max(deadline - version, 0) * num_groups:
            return None  # one due by then has not finished
    if len(chosen) > num_groups:
        return None  # more due than a batch: admission keeps this from happening
    freshest = sorted(earliest, key=lambda g: g.order, reverse=True)
    return chosen + freshest[: num_groups - len(chosen)]


@dataclass
class CarryCounts:
    """What a rank's carried groups did so far, in episodes, and each written group's staleness."""

    started: int = 0
    written: int = 0
    staleness: Counter[int] = field(default_factory=Counter)  # versions behind -> groups written that many behind


class CarriedEpisodes:
    """One actor rank's open episode groups on one `AgentLoop`, carried across weight updates: `admit`
    adds groups (within `admission_room`), `next_batch` runs the episodes until a batch can be written
    (`batch_of`) and takes it out. One rollout holds every open episode, so one engine steps all of them
    and their sessions and environment steps go on between batches (agent/episode_loop.py, "Rounds")."""

    def __init__(self, loop: AgentLoop, *, num_groups: int, max_staleness: int, seed: int):
        assert max_staleness >= 0, f"a staleness bound is >= 0 (the config's), got {max_staleness}"
        self.loop, self.num_groups, self.max_staleness = loop, num_groups, max_staleness
        self.rollout = Rollout([], seed, greedy=False)
        self.groups: list[CarriedGroup] = []
        self.counts = CarryCounts()
        self._admitted = 0

    @property
    def open_episodes(self) -> int:
        """Episodes admitted and not written yet."""
        return sum(len(group.episodes) for group in self.groups)

    @property
    def room(self) -> int:
        """Groups `admit` may add now."""
        return admission_room(len(self.groups), num_groups=self.num_groups, max_staleness=self.max_staleness)

    def admit(
        self,
        prompts: Sequence[list[int]],
        *,
        keys: Sequence[Sequence[int]],
        contexts: Sequence[EpisodeContext | None],
        version: int,
        tags: Sequence[Any] | None = None,
    ) -> None:
        """One group per prompt, its episodes keyed by `keys` (one key per episode, new to this rank),
        admitted while the policy is at `version`; `tags`: each group's `CarriedGroup.prompt`."""
        # the rank admits a batch's groups within its room (agent_carry.py, `batches_ahead`)
        assert len(prompts) <= self.room, f"{len(prompts)} groups admitted with room for {self.room}"
        for prompt, group_keys, context, tag in zip(prompts, keys, contexts, tags or [None] * len(prompts)):
            episodes = self.loop.admit(
                self.rollout, [prompt] * len(group_keys), group_keys, [context] * len(group_keys)
            )
            self.groups.append(
                CarriedGroup(tuple(episodes), version, version + self.max_staleness, self._admitted, tag)
            )
            self._admitted += 1
            self.counts.started += len(episodes)

    def next_batch(self, *, version: int) -> list[CarriedGroup]:
        """Run the open episodes on the weights of `version` until the batch at `version` can be written;
        that batch, taken out. The others stay open (their turns to sample wait for the next call)."""

        def batch() -> list[CarriedGroup] | None:
            return batch_of(self.groups, version=version, num_groups=self.num_groups)

        self.loop.advance(self.rollout, policy_version=version, logprobs=True, until=lambda: batch() is not None)
        written = batch()
        if written is None:
            raise RuntimeError(
                f"{len(self.groups)} groups open cannot fill a batch of {self.num_groups}: admit more before it"
            )
        taken = {id(group) for group in written}
        self.groups = [group for group in self.groups if id(group) not in taken]
        self.rollout.remove([episode for group in written for episode in group.episodes])
        for group in written:
            self.counts.written += len(group.episodes)
            self.counts.staleness[version - group.version] += 1
        return written

    def abandon(self) -> None:
        """Stop every open episode and close its session (the job ends or fails)."""
        self.loop.abandon(self.rollout)
        self.groups = []
