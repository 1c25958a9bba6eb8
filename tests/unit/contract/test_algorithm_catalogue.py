"""The algorithm catalogue is what the config accepts and what the config's device count uses."""

from typing import get_args

from rldock.config.algorithm import AlgorithmSpec
from rldock.contract.algorithms import CATALOGUE, needs_critic


def test_config_accepts_exactly_the_catalogue():
    assert set(get_args(AlgorithmSpec.model_fields["name"].annotation)) == set(CATALOGUE)


def test_ppo_family_runs_a_critic_and_dpo_no_rollout():
    assert {name for name in CATALOGUE if needs_critic(name)} == {"ppo", "pf_ppo"}
    assert [name for name, traits in CATALOGUE.items() if not traits.needs_rollout] == ["dpo"]
