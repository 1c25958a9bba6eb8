"""The prompt ledger: what became of every prompt group the job's feed drew, so that a run stopped and
resumed (SIGTERM, a preemption, a worker's death) shows that it lost none and trained none twice.

A group is named by its draw number (feed.Feed's `prompt_draw`: 0, 1, ... in the sampler's order, across
epochs). Each iteration settles the groups it is done with:
- trained: its update's samples belong to them, as read back from the dock through sample_facts (a carried
  group counts in the iteration that trained it, not the one that drew it);
- passed over: put into the iteration's bank and not trained, the algorithm's choice and not a loss (DAPO's
  filter dropped the group, or the dock's staleness bound dropped its samples).
Every other group drawn is open: a carry job's groups its rollout ranks hold (rollout/agent_carry.py), the
groups a run-ahead schedule drew for the next iteration, or a carry job's last fresh groups, which no rank
has room left to admit.

The ledger is saved with each checkpoint (`ledger.json`). An attempt that starts from a checkpoint (or, with
none yet, from the run's start) draws that ledger's open groups again before any new prompt
(`Feed.requeue`): an episode a rank held when the run stopped is generated anew on the checkpoint's weights,
its prompt is not lost. So every group a run drew ends trained once, passed over once, or open at the run's
end, and a group trained twice, or trained after it was passed over (`trained_twice`, which no schedule should
ever produce), is counted in every record.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

LEDGER_FILE = "ledger.json"


class PromptLedger:
    """Draw number -> the iteration that trained or passed over the group; the rest drawn are open."""

    def __init__(self, since: int = 0) -> None:
        """`since`: the first draw the ledger accounts for (a checkpoint saved before ledgers existed: its
        sampler position; the groups before it are not known)."""
        self.since = since
        self.trained: dict[int, int] = {}
        self.passed_over: dict[int, int] = {}
        self.trained_twice: list[int] = []

    def settle(self, iteration: int, *, read: Iterable[int], put: Iterable[int] | None, drawn: int) -> dict[str, int]:
        """Settle `iteration`'s groups and return the record's `prompts/` counts of them. `read`: the groups
        of the samples the driver read back (sample_facts; with DAPO every round's); `put`: the groups the
        iteration's bank holds at its end (DAPO: the kept ones), which a mode that finishes each iteration's
        groups in it trains or passes over there, or None where rollout ranks hold groups across iterations
        (carried episodes): then what was read is what trained. `drawn`: the feed's position now."""
        read = set(read)
        trained = read if put is None else read & set(put)
        passed = set() if put is None else (read | set(put)) - trained
        for draw in sorted(trained):
            if draw in self.trained or draw in self.passed_over:
                self.trained_twice.append(draw)
                logger.error("prompt group %d trained again in iteration %d", draw, iteration)
            else:
                self.trained[draw] = iteration
        for draw in passed - self.trained.keys():
            self.passed_over.setdefault(draw, iteration)
        return {
            "prompts/trained_groups": len(trained),
            "prompts/passed_over_groups": len(passed),
            "prompts/open_groups": drawn - self.since - len(self.trained) - len(self.passed_over),
            "prompts/trained_twice": len(self.trained_twice),
        }

    def open_below(self, drawn: int) -> list[int]:
        """The groups drawn before draw number `drawn` that are neither trained nor passed over, ascending."""
        return [d for d in range(self.since, drawn) if d not in self.trained and d not in self.passed_over]

    def summary(self, drawn: int) -> dict[str, int]:
        """Counts of the groups drawn before `drawn` by what became of them."""
        return {
            "drawn": drawn - self.since,
            "trained": len(self.trained),
            "passed_over": len(self.passed_over),
            "open": len(self.open_below(drawn)),
            "trained_twice": len(self.trained_twice),
        }

    def save(self, directory: Path, *, drawn: int) -> None:
        """Write the ledger into a checkpoint's `directory`, whose feed position is `drawn`."""
        by_iteration: dict[int, list[int]] = {}
        for draw, iteration in sorted(self.trained.items()):
            by_iteration.setdefault(iteration, []).append(draw)
        passed: dict[int, list[int]] = {}
        for draw, iteration in sorted(self.passed_over.items()):
            passed.setdefault(iteration, []).append(draw)
        state = {
            "summary": self.summary(drawn),
            "since": self.since,
            "drawn": drawn,
            "trained": {str(i): draws for i, draws in sorted(by_iteration.items())},
            "passed_over": {str(i): draws for i, draws in sorted(passed.items())},
            "trained_twice": self.trained_twice,
        }
        (Path(directory) / LEDGER_FILE).write_text(json.dumps(state, indent=1))

    @classmethod
    def load(cls, directory: Path, *, drawn: int) -> PromptLedger:
        """The ledger a checkpoint's `directory` holds; one since `drawn` (its feed position) where it holds
        none (saved before ledgers existed)."""
        path = Path(directory) / LEDGER_FILE
        if not path.is_file():
            return cls(since=drawn)
        state = json.loads(path.read_text())
        ledger = cls(since=state["since"])
        ledger.trained = {d: int(i) for i, draws in state["trained"].items() for d in draws}
        ledger.passed_over = {d: int(i) for i, draws in state["passed_over"].items() for d in draws}
        ledger.trained_twice = list(state["trained_twice"])
        return ledger
