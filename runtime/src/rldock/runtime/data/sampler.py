"""The prompt sampler: walks the prompt set in seeded epochs.

The trainer never picks prompts itself: it asks a `PromptSampler` for the next indexes, so that a
job resumed from a checkpoint (which saves `PromptSampler.state_dict()`) sees exactly the prompts
it would have seen.
"""

from __future__ import annotations

import numpy as np


class PromptSampler:
    """Draws prompt indexes in shuffled epochs; the order is a pure function of (seed, epoch).

    `next_batch(n)` continues across epoch boundaries, so every prompt is used once per epoch.
    """

    def __init__(self, num_prompts: int, seed: int):
        if num_prompts < 1:
            raise ValueError(f"the prompt set must hold at least 1 prompt, got {num_prompts}")
        self.num_prompts = num_prompts
        self.seed = seed
        self._epoch = 0
        self._position = 0  # index into this epoch's permutation
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        # Seeding with (seed, epoch) rather than one running stream means a resumed sampler can
        # rebuild any epoch's order without replaying the ones before it.
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def next_batch(self, n: int) -> list[int]:
        """The next `n` prompt indexes (may wrap into the next epoch)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        out: list[int] = []
        while len(out) < n:
            if self._position == self.num_prompts:
                self._epoch += 1
                self._position = 0
                self._order = self._permutation(self._epoch)
            take = min(n - len(out), self.num_prompts - self._position)
            out.extend(int(i) for i in self._order[self._position : self._position + take])
            self._position += take
        return out

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def drawn(self) -> int:
        """How many prompts were drawn so far: the next draw's number (a draw is numbered 0, 1, ...
        across epochs; the prompt ledger names a prompt group by it)."""
        return self._epoch * self.num_prompts + self._position

    def prompt_of(self, draw: int) -> int:
        """The prompt index draw number `draw` gave (or will give): a pure function of (seed, draw)."""
        assert draw >= 0, "draws are numbered from 0"
        epoch, position = divmod(draw, self.num_prompts)
        order = self._order if epoch == self._epoch else self._permutation(epoch)
        return int(order[position])

    @staticmethod
    def drawn_in(state: dict[str, int]) -> int:
        """`drawn` of a sampler in `state` (a `state_dict`)."""
        return state["epoch"] * state["num_prompts"] + state["position"]

    def state_dict(self) -> dict[str, int]:
        return {
            "num_prompts": self.num_prompts,
            "seed": self.seed,
            "epoch": self._epoch,
            "position": self._position,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position; the prompt set and seed must be the same as when saved."""
        if state["num_prompts"] != self.num_prompts:
            raise ValueError(
                f"sampler state was saved for a prompt set of {state['num_prompts']} prompts, "
                f"but this job has {self.num_prompts}; resume with the same data section and "
                "algorithm.max_prompt_length"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"sampler state was saved with shuffle seed {state['seed']}, but this job has {self.seed} "
                "(data.shuffle_seed, default seed)"
            )
        if not 0 <= state["position"] <= self.num_prompts:
            raise ValueError(f"sampler state position {state['position']} is outside 0..{self.num_prompts}")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        self._order = self._permutation(self._epoch)
