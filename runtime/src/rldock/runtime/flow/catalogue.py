"""The recipe catalogue: every algorithm's recipe (its worker states in launch order, its advantage
stage and policy loss), registered by name, and the lookup by name. Adding an algorithm is adding a
recipe here (and its pure tensor functions in algorithms/), not an `if` in the driver.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from rldock.config.algorithm import AlgorithmSpec
from rldock.runtime.algorithms.advantages import get_advantage_estimator
from rldock.runtime.algorithms.dapo import informative_groups, overlong_penalty
from rldock.runtime.algorithms.episode_rows import at_heads, episode_share, episode_sums, one_per_row, to_rows
from rldock.runtime.algorithms.filtration import filtration_weights
from rldock.runtime.algorithms.gae import GAE_UNITS, GaeInputs, GaeResult, masked_whiten
from rldock.runtime.algorithms.gspo import gspo_policy_loss  # noqa: F401  registers the "gspo" loss
from rldock.runtime.algorithms.turn_credit import turn_credit_stage
from rldock.runtime.algorithms.turns import rewards_per_turn
from rldock.runtime.flow.columns import PROMPT, PROMPT_DRAW, RESPONSE, RESPONSE_LENGTH
from rldock.runtime.flow.recipe import RECIPES, AdvantageStage, Recipe, SamplingRounds, register_recipe
from rldock.runtime.flow.states import (
    ACTOR_INFERENCE,
    ADVANTAGE_STATE,
    CRITIC_INFERENCE,
    CRITIC_UPDATE,
    PREFERENCE_UPDATE,
    REFERENCE_INFERENCE,
    REWARD_STATE,
    ROLLOUT,
    SAMPLE_FACTS,
    UPDATE,
    WorkerState,
)


def get_recipe(name: str) -> Recipe:
    return RECIPES.get(name)


# --- advantage stages ----------------------------------------------------------------------------


def episodes_of(batch) -> torch.Tensor:
    """The batch's episode column (B,): the dock's where an episode is several rows (a harness's segments),
    else one episode per row."""
    return batch["episode"] if "episode" in batch.keys() else one_per_row(len(batch["reward"]))


def episode_columns(batch, advantages: torch.Tensor, episode: torch.Tensor) -> dict[str, torch.Tensor]:
    """The advantage stage's columns: each episode's advantage (E,) on its every row, and where the flow has
    segments each row's share of its episode's tokens (what the loss's sequence means count episodes by)."""
    columns = {"advantage": to_rows(advantages, episode)}  # (B,)
    if "episode" in batch.keys():
        columns["episode_share"] = episode_share(batch["response_mask"], episode)  # (B,)
    return columns


def group_advantage_stage(estimator: str) -> AdvantageStage:
    """Outcome advantages from whole groups of episodes' rewards by a registered estimator: (B,) per row, an
    episode's rows sharing its advantage (its N - 1 siblings its baseline, whatever its segments)."""
    fn = get_advantage_estimator(estimator)

    def stage(batch, algo, generator):
        episode = episodes_of(batch)
        return episode_columns(batch, fn(at_heads(batch["reward"], episode), algo.num_responses_per_prompt), episode)

    return stage


def batch_advantage_stage(estimator: str) -> AdvantageStage:
    """Outcome advantages normalised over the iteration's whole batch by a registered estimator
    (REINFORCE++), each episode weighted by its tokens over all its rows: (B,) per row."""
    fn = get_advantage_estimator(estimator)

    def stage(batch, algo, generator):
        episode = episodes_of(batch)
        token_counts = episode_sums(batch["response_mask"].sum(dim=1), episode)  # (E,)
        rewards = at_heads(batch["reward"], episode)  # (E,)
        return episode_columns(batch, fn(rewards, algo.num_responses_per_prompt, token_counts=token_counts), episode)

    return stage


def _gae(batch, algo: AlgorithmSpec) -> GaeResult:
    """GAE by algorithm.gae_unit over the rewards per turn algorithm.credit places (a single-turn
    response: one turn, its reward on its last token)."""
    per_turn, turn_index = rewards_per_turn(batch, algo.credit)  # (B, K), (B, SL)
    inputs = GaeInputs(per_turn, batch["values"], batch["response_mask"], turn_index)
    return GAE_UNITS.get(algo.gae_unit)(inputs, gamma=algo.ppo.gamma, lam=algo.ppo.lam)


def gae_stage(batch, algo, generator):
    """PPO: GAE advantages (B, SL), the critic's returns (B, SL) and where it trains on them (B, SL)."""
    gae = _gae(batch, algo)
    advantages = gae.advantages
    if algo.ppo.whiten_advantages:
        advantages = masked_whiten(advantages, batch["response_mask"])
    return {"advantage": advantages, "returns": gae.returns, "value_mask": gae.value_mask}


def filtered_gae_stage(batch, algo, generator):
    """PF-PPO: PPO's advantages and each response's filtration weight (B,), which the update's loss
    aggregation applies to the response's tokens, in the sum and in the count: a response of weight
    0 adds nothing, as if it were never sampled. Whitening uses only the responses that are kept,
    so the kept ones are centred among themselves. The critic still trains on every response's
    returns: its values must track the sampling policy."""
    gae = _gae(batch, algo)
    advantages, mask = gae.advantages, batch["response_mask"]
    weights = filtration_weights(
        batch["reward"], algo.num_responses_per_prompt, algo.pf_ppo.mode, power=algo.pf_ppo.power, generator=generator
    )  # (B,)
    kept = (weights > 0).unsqueeze(1)  # (B, 1)
    if algo.ppo.whiten_advantages:
        advantages = masked_whiten(advantages, mask * kept)
    return {
        "advantage": advantages * kept,
        "returns": gae.returns,
        "value_mask": gae.value_mask,
        "loss_weight": weights,
    }


# --- recipes -------------------------------------------------------------------------------------

# GRPO's flow: the states every other recipe starts from.
# Every recipe ends with the driver's read of the samples' facts (states.SAMPLE_FACTS).
GRPO_STATES = (ROLLOUT, ACTOR_INFERENCE, REFERENCE_INFERENCE, REWARD_STATE, ADVANTAGE_STATE, UPDATE, SAMPLE_FACTS)


def _changed(states: tuple[WorkerState, ...], *changes: WorkerState) -> tuple[WorkerState, ...]:
    """`states` with each state of `changes` replacing the one of its name (or added at the end)."""
    by_name = {change.name: change for change in changes}
    kept = tuple(by_name.pop(spec.name, spec) for spec in states)
    return kept + tuple(by_name.values())


# PPO (and PF-PPO): GRPO's states plus a critic's; the advantage (GAE) reads the critic's values
# and writes the returns the critic trains on and where it trains (`value_mask` (B, SL) int64: the model's
# tokens, or under gae_unit turn each turn's first token).
PPO_STATES = _changed(
    GRPO_STATES,
    replace(
        ADVANTAGE_STATE,
        consumes=("reward", "values", "response_mask"),
        produces=("advantage", "returns", "value_mask"),
    ),
    CRITIC_INFERENCE,
    replace(CRITIC_UPDATE, consumes=CRITIC_UPDATE.consumes + ("value_mask",)),
)
# PF-PPO: each response's filtration weight (B,) float32 >= 0, which the update's loss aggregation
# applies to its tokens (0: the response adds nothing to the loss or its count).
PF_PPO_STATES = _changed(
    PPO_STATES,
    replace(UPDATE, consumes=UPDATE.consumes + ("loss_weight",)),
    replace(
        ADVANTAGE_STATE,
        consumes=("reward", "values", "response_mask"),
        produces=("advantage", "returns", "value_mask", "loss_weight"),
    ),
)
# REINFORCE++ (and its baseline variant): the advantage state normalises over the iteration's whole
# batch, each response weighted by its tokens, so it reads the response mask.
BATCH_NORMALISED_STATES = _changed(GRPO_STATES, replace(ADVANTAGE_STATE, consumes=("reward", "response_mask")))


def _group_recipe(name: str) -> Recipe:
    """GRPO's flow with the group baseline of the estimator `name`, by trajectory or by turn."""
    return Recipe(
        name,
        GRPO_STATES,
        advantage_stage=group_advantage_stage(name),
        policy_loss="clipped",
        turn_credit_stage=turn_credit_stage(name),
    )


register_recipe(_group_recipe("grpo"))
# PPO and PF-PPO whiten over the iteration's batch (as verl does), so their stage sees all of it.
register_recipe(
    Recipe("ppo", PPO_STATES, advantage_stage=gae_stage, policy_loss="clipped", advantage_scope="iteration")
)
register_recipe(
    Recipe(
        "pf_ppo", PF_PPO_STATES, advantage_stage=filtered_gae_stage, policy_loss="clipped", advantage_scope="iteration"
    )
)
# RLOO: GRPO's flow with the leave-one-out baseline (whole groups, so the reward state can run it).
register_recipe(_group_recipe("rloo"))
# REINFORCE++ normalises over the iteration's batch (as PPO whitens), so its stage sees all of it.
register_recipe(
    Recipe(
        "reinforce_plus_plus",
        BATCH_NORMALISED_STATES,
        advantage_stage=batch_advantage_stage("reinforce_plus_plus"),
        policy_loss="clipped",
        advantage_scope="iteration",
        turn_credit_stage=turn_credit_stage("reinforce_plus_plus"),
    )
)
register_recipe(
    Recipe(
        "reinforce_plus_plus_baseline",
        BATCH_NORMALISED_STATES,
        advantage_stage=batch_advantage_stage("reinforce_plus_plus_baseline"),
        policy_loss="clipped",
        advantage_scope="iteration",
        turn_credit_stage=turn_credit_stage("reinforce_plus_plus_baseline"),
    )
)


def _gspo_kwargs(algo: AlgorithmSpec) -> dict:
    return {"clip_ratio_low": algo.gspo.clip_ratio_low, "clip_ratio_high": algo.gspo.clip_ratio_high}


# GSPO: GRPO's advantages, the sequence-ratio loss.
register_recipe(
    Recipe(
        "gspo",
        GRPO_STATES,
        advantage_stage=group_advantage_stage("grpo"),
        policy_loss="gspo",
        policy_loss_kwargs=_gspo_kwargs,
        turn_credit_stage=turn_credit_stage("grpo"),
    )
)


# --- DAPO and DPO --------------------------------------------------------------------------------


def _decoupled_clip_kwargs(algo: AlgorithmSpec) -> dict:
    return {
        "clip_ratio_low": algo.dapo.clip_ratio_low,
        "clip_ratio_high": algo.dapo.clip_ratio_high,
        "clip_ratio_c": algo.clip_ratio_c,
    }


def _overlong_shaping(rewards: torch.Tensor, response_lengths: torch.Tensor, algo: AlgorithmSpec) -> torch.Tensor:
    spec = algo.dapo
    if spec.overlong_buffer_length == 0:
        return rewards
    return rewards + overlong_penalty(
        response_lengths,
        max_length=algo.max_response_length,
        buffer_length=spec.overlong_buffer_length,
        penalty_factor=spec.overlong_penalty_factor,
    )


def _keep_every_group(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    return torch.ones(rewards.numel() // group_size, dtype=torch.bool)


def _dapo_group_filter(algo: AlgorithmSpec) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """On the unshaped score (accuracy), as in the paper: overlong shaping must not make a group of
    equally correct answers look informative."""
    return informative_groups if algo.dapo.dynamic_sampling else _keep_every_group


def dapo_advantage_stage(batch, algo, generator):
    """GRPO's advantages on the shaped reward, exactly 0 in every group whose unshaped scores are all
    equal: the padded groups dynamic sampling could not replace, and with dynamic_sampling false
    every such group. Dividing by their std would otherwise turn the overlong penalty alone into
    full-size advantages (all correct, one response 0.01 shorter of the ramp: +0.35 x7 and -2.47).
    Zeroed, not dropped: their tokens stay in the token mean's count, as the samples stay in the
    batch. (B,) per sample."""
    group_size, episode = algo.num_responses_per_prompt, episodes_of(batch)
    advantages = get_advantage_estimator("grpo")(at_heads(batch["reward"], episode), group_size)  # (E,)
    keep = informative_groups(at_heads(batch["score"], episode), group_size).repeat_interleave(group_size)  # (E,)
    return episode_columns(batch, torch.where(keep, advantages, torch.zeros_like(advantages)), episode)


# DAPO: GRPO's states; with dynamic sampling the driver reads each round's per-sample `score` (the
# rule reward before overlong shaping, (B,) floats) and response lengths through `sample_facts` (the
# only columns that reach the driver), and the dock empties and refills the groups it drops; the
# samples of the kept groups stay in the warehouses for the remaining states. The reward writes the
# shaped reward (what the advantages use) and the unshaped score (what the filter uses); the
# advantage reads the score too: a group whose scores are all equal gets advantage exactly 0.
DAPO_STATES = _changed(GRPO_STATES, replace(ADVANTAGE_STATE, consumes=("reward", "score")))
register_recipe(
    Recipe(
        "dapo",
        DAPO_STATES,
        advantage_stage=dapo_advantage_stage,
        policy_loss="decoupled_clip",
        policy_loss_kwargs=_decoupled_clip_kwargs,
        reward_shaping=_overlong_shaping,
        sampling_rounds=SamplingRounds(
            states=(ROLLOUT.name, REWARD_STATE.name), read_state=SAMPLE_FACTS.name, group_filter=_dapo_group_filter
        ),
    )
)
# DPO: the driver puts chosen/rejected pairs as finished responses (no rollout, reward or
# advantage); the reference scores them and the actor trains on the preference loss.
register_recipe(
    Recipe(
        "dpo",
        (REFERENCE_INFERENCE, PREFERENCE_UPDATE, replace(SAMPLE_FACTS, consumes=RESPONSE_LENGTH + PROMPT_DRAW)),
        advantage_stage=None,
        policy_loss=None,
        driver_batch="preference_pairs",
        driver_produces=PROMPT + RESPONSE + RESPONSE_LENGTH + PROMPT_DRAW,
        update_state=PREFERENCE_UPDATE.name,
        reference_for_kl_only=False,
    )
)
