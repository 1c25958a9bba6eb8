"""The algorithm catalogue: the algorithms rldock runs and what each needs from the cluster.

The config's `algorithm.name` accepts exactly these names, the config checks read
`needs_critic` to count devices (a critic takes one), and the runtime's recipes
(rldock.runtime.flow.catalogue) must agree: a recipe registered for a name not in the
catalogue, or whose critic states disagree with `needs_critic`, fails at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

AlgorithmName = Literal[
    "grpo", "ppo", "pf_ppo", "dapo", "dpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gspo"
]


@dataclass(frozen=True)
class AlgorithmTraits:
    needs_critic: bool  # runs a critic worker (one more device)
    needs_rollout: bool  # generates responses with an engine (DPO trains on given pairs)
    # credits a multi-turn episode's turns apart (algorithm.credit: turn): a turn-level estimator, or a critic
    credits_turns: bool = False


CATALOGUE: dict[str, AlgorithmTraits] = {
    "grpo": AlgorithmTraits(needs_critic=False, needs_rollout=True, credits_turns=True),
    "ppo": AlgorithmTraits(needs_critic=True, needs_rollout=True, credits_turns=True),
    "pf_ppo": AlgorithmTraits(needs_critic=True, needs_rollout=True, credits_turns=True),
    "dapo": AlgorithmTraits(needs_critic=False, needs_rollout=True),
    "dpo": AlgorithmTraits(needs_critic=False, needs_rollout=False),
    "rloo": AlgorithmTraits(needs_critic=False, needs_rollout=True, credits_turns=True),
    "reinforce_plus_plus": AlgorithmTraits(needs_critic=False, needs_rollout=True, credits_turns=True),
    "reinforce_plus_plus_baseline": AlgorithmTraits(needs_critic=False, needs_rollout=True, credits_turns=True),
    "gspo": AlgorithmTraits(needs_critic=False, needs_rollout=True, credits_turns=True),
}

assert set(CATALOGUE) == set(get_args(AlgorithmName)), "the catalogue and AlgorithmName disagree"


def needs_critic(name: str) -> bool:
    return CATALOGUE[name].needs_critic


def needs_rollout(name: str) -> bool:
    return CATALOGUE[name].needs_rollout


def credits_turns(name: str) -> bool:
    return CATALOGUE[name].credits_turns


def critic_free_rollout_algorithms() -> list[str]:
    """The algorithms that sample a rollout and train without a critic (the catalogue's)."""
    return [name for name, traits in CATALOGUE.items() if traits.needs_rollout and not traits.needs_critic]
