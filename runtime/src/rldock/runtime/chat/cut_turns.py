"""A turn cut at a weight update and resumed on the new weights: the one machinery both episode sources run
(rollout.partial_rollout resume with `agent`): rldock's own loop (agent/episode_loop.py, "Rounds") and the
gateway a harness's requests reach (gateway/server.py, `EngineTurns`).

A round samples on one policy version with a token budget per episode (rollout.max_tokens_per_round; None:
no budget, the round runs every turn to its end). A turn is one engine request; its limit is the episode's
own (what its context leaves, at most what the request asked). `RoundBudget.request` gives the engine's
request for it: the prompt, then the tokens of the turn already sampled (a cut turn's, from the round
before), at most the rest of the turn's limit and of the episode's budget in this round. When the engine
answers, `RoundBudget.took` joins the answer to those tokens, each token with the version that sampled it
and its logprob then (`CutTurn`), and says whether the budget cut the turn (no end-of-turn token, its own
limit not reached, the budget spent): the next round resumes it with that request again. So a turn spans
the versions of the rounds it ran in, every token kept, none sampled twice.

A resumed request draws its own sampling stream: its key is the turn's with the count of tokens already
sampled appended, so a resumed run samples the same rest given the same weights.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from rldock.runtime.engines.vllm_rollout import Completion


@dataclass(frozen=True)
class CutTurn:
    """The tokens of a turn so far, each with the version that sampled it and its logprob then: a turn a
    round's budget stopped before its end (the next round samples its rest from them), or a whole turn."""

    token_ids: list[int]
    versions: list[int]
    logprobs: list[float]

    def joined(self, completion: Completion, *, version: int) -> CutTurn:
        """This cut turn followed by `completion`, sampled by `version`."""
        return CutTurn(
            self.token_ids + list(completion.token_ids),
            self.versions + [version] * len(completion.token_ids),
            self.logprobs + logprobs_of(completion),
        )


EMPTY_TURN = CutTurn([], [], [])


def logprobs_of(completion: Completion) -> list[float]:
    """Each token's logprob, 0.0 where the engine was not asked for them."""
    return list(completion.logprobs) if completion.logprobs is not None else [0.0] * len(completion.token_ids)


@dataclass(frozen=True)
class TurnRequest:
    """The engine's request for (the rest of) a turn."""

    prompt_ids: list[int]
    max_tokens: int
    key: tuple[int, ...]  # the turn's sampling key, with the tokens already sampled appended when resumed


@dataclass
class RoundBudget:
    """One round on the weights of `policy_version`: each episode (any hashable name of it) may sample
    `round_tokens` tokens in it (None: no budget)."""

    round_tokens: int | None
    policy_version: int = 0
    sampled: Counter[Hashable] = field(default_factory=Counter)  # episode -> tokens sampled in this round

    def has_budget(self, episode: Hashable) -> bool:
        return self.round_tokens is None or self.sampled[episode] < self.round_tokens

    def request(
        self, episode: Hashable, *, prompt_ids: Sequence[int], turn_limit: int, key: tuple[int, ...], cut: CutTurn
    ) -> TurnRequest:
        """The request for a turn of `episode` after `prompt_ids`, of at most `turn_limit` tokens in all,
        `cut` of them sampled already."""
        limit = turn_limit - len(cut.token_ids)
        if self.round_tokens is not None:
            limit = min(limit, self.round_tokens - self.sampled[episode])
        resumed = (len(cut.token_ids),) if cut.token_ids else ()
        return TurnRequest([*prompt_ids, *cut.token_ids], limit, (*key, *resumed))

    def took(self, episode: Hashable, completion: Completion, *, cut: CutTurn, turn_limit: int) -> tuple[CutTurn, bool]:
        """The turn so far (`cut`, then `completion` of this round's version) and whether the budget cut it:
        it stopped without its end-of-turn token short of `turn_limit`, the episode's budget spent."""
        turn = cut.joined(completion, version=self.policy_version)
        self.sampled[episode] += len(completion.token_ids)
        stopped = not self.has_budget(episode) and not completion.finished_with_eos and len(turn.token_ids) < turn_limit
        return turn, stopped
