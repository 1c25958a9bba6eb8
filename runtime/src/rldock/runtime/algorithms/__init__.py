"""RL algorithm pieces as pure tensor functions, registered by name so callers never branch on an
algorithm: advantage estimators, policy losses, KL estimators."""

from rldock.runtime.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    grpo_advantages,
    grpo_mean_only_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from rldock.runtime.algorithms.core import masked_mean

# Imported for their registrations: every policy loss is in POLICY_LOSSES once this package is.
from rldock.runtime.algorithms.dapo import decoupled_clip_policy_loss
from rldock.runtime.algorithms.gspo import gspo_policy_loss
from rldock.runtime.algorithms.kl import KL_ESTIMATORS, kl_penalty
from rldock.runtime.algorithms.losses import (
    POLICY_LOSSES,
    PolicyLoss,
    clipped_policy_loss,
    clipped_sequence_mean_policy_loss,
    get_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "PolicyLoss",
    "clipped_policy_loss",
    "clipped_sequence_mean_policy_loss",
    "decoupled_clip_policy_loss",
    "get_advantage_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "grpo_mean_only_advantages",
    "gspo_policy_loss",
    "kl_penalty",
    "masked_mean",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
]
