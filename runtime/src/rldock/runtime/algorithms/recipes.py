"""Algorithm recipes: what one RL algorithm runs, as data, so the trainer and workers never branch
on `algorithm.name`.

A recipe names the worker states that run each iteration with the dock columns each consumes
(the dock is created from `consumes`, the trainer launches exactly those states), the advantage
stage that turns the advantage state's columns into its outputs, and the registered policy loss
the actor's update calls. Adding an algorithm is adding a recipe here (and its pure pieces beside
it), not an `if` in the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from rldock.config.job import AlgorithmSpec, JobConfig
from rldock.contract.algorithms import CATALOGUE
from rldock.runtime.algorithms.advantages import get_advantage_estimator
from rldock.runtime.algorithms.dapo import informative_groups, overlong_penalty
from rldock.runtime.algorithms.filtration import filtration_weights
from rldock.runtime.algorithms.gae import GAE_UNITS, GaeInputs, GaeResult, masked_whiten
from rldock.runtime.algorithms.gspo import gspo_policy_loss  # noqa: F401  registers the "gspo" loss
from rldock.runtime.algorithms.importance import IMPORTANCE_WEIGHT
from rldock.runtime.algorithms.turn_credit import turn_credit_stage
from rldock.runtime.algorithms.turns import rewards_per_turn
from rldock.runtime.dataflow import (
    AGENT_PARTIAL_ROLLOUT,
    PARTIAL_ROLLOUT,
    POLICY_VERSION,
    PROMPT,
    PROMPT_INDEX,
    RESPONSE,
    RESPONSE_ATTENTION,
    RESPONSE_LENGTH,
    RM_SCORE,
    ROUTED_EXPERTS,
    TRAJECTORY_COUNTS,
    TURNS,
)
from rldock.runtime.registry import Registry
from rldock.runtime.states import (
    ACTOR,
    ACTOR_INFERENCE,
    ADVANTAGE_STATE,
    CRITIC,
    CRITIC_INFERENCE,
    CRITIC_UPDATE,
    PREFERENCE_UPDATE,
    REFERENCE_INFERENCE,
    REWARD_MODEL,
    REWARD_STATE,
    ROLLOUT,
    SAMPLE_FACTS,
    UPDATE,
    WorkerState,
    worker_groups,
)

# (batch columns of the advantage state, algorithm spec, generator for any sampling) -> the
# columns to write back, each with the batch's leading dimension B.
AdvantageStage = Callable[[Mapping[str, torch.Tensor], AlgorithmSpec, torch.Generator], dict[str, torch.Tensor]]


# Reward shaping applied by the reward stage: (rule rewards (B,), response lengths (B,), algorithm
# spec) -> the rewards written to the dock (B,).
RewardShaping = Callable[[torch.Tensor, torch.Tensor, AlgorithmSpec], torch.Tensor]


def _clip_ratio_kwargs(algo: AlgorithmSpec) -> dict:
    return {"clip_ratio": algo.clip_ratio, "clip_ratio_c": algo.clip_ratio_c}


def _unshaped(rewards: torch.Tensor, response_lengths: torch.Tensor, algo: AlgorithmSpec) -> torch.Tensor:
    return rewards


@dataclass(frozen=True)
class SamplingRounds:
    """States the driver runs in rounds before the rest (DAPO's dynamic sampling): each round puts
    fresh prompts into the dock's empty group slots, runs `states`, reads only `score_column` of
    them through `read_state` and keeps the groups `group_filter(algo)` accepts; the dock empties
    the other slots for the next round, until G groups are kept (runtime/src/rldock/runtime/sampling.py)."""

    states: tuple[str, ...]
    read_state: str
    group_filter: Callable[[AlgorithmSpec], Callable[[torch.Tensor, int], torch.Tensor]]
    score_column: str = "score"  # (B,) per sample, what the filter reads


@dataclass(frozen=True)
class Recipe:
    name: str
    # The worker states that run each iteration, in launch order (runtime/src/rldock/runtime/states.py).
    specs: tuple[WorkerState, ...]
    advantage_stage: AdvantageStage | None  # None: the recipe has no advantage state (DPO)
    policy_loss: str | None  # a name in POLICY_LOSSES; None: the update state has its own loss (DPO)
    # keyword arguments of the policy loss besides the tensors, from the algorithm spec
    policy_loss_kwargs: Callable[[AlgorithmSpec], dict] = _clip_ratio_kwargs
    reward_shaping: RewardShaping = _unshaped
    # what the driver puts each iteration: "prompt_groups" (G prompts x N) or "preference_pairs"
    # (G chosen/rejected pairs), a name in runtime/src/rldock/runtime/sampling.py's BATCH_BUILDERS
    driver_batch: str = "prompt_groups"
    driver_produces: tuple[str, ...] = PROMPT + PROMPT_INDEX  # the dock columns the driver puts
    sampling_rounds: SamplingRounds | None = None
    update_state: str = "update"  # the state whose results carry the training metrics
    # What one call of the advantage stage sees: "groups" (whole prompt groups, as they become
    # ready: GRPO's baselines need nothing else) or "iteration" (the iteration's whole batch, for
    # statistics over the batch such as PPO's advantage whitening, so the result does not depend
    # on how the dock happened to split the samples).
    advantage_scope: str = "groups"
    # The reference's logprobs feed only the KL penalty, so a job with kl_coef 0 skips the
    # reference state; False where the loss itself needs them (DPO).
    reference_for_kl_only: bool = True
    # The reward state also runs the advantage stage on each group it scores and writes both in one
    # dock write; there is no advantage state (`with_advantage_in_reward`; JobConfig.ablations turns it off).
    advantage_in_reward: bool = False
    # The advantage stage of `algorithm.credit: turn` (algorithms/turn_credit.py), which `with_turns` puts
    # in place of `advantage_stage`; None where the recipe has none (a critic's GAE reads algorithm.credit
    # itself; DAPO, DPO).
    turn_credit_stage: AdvantageStage | None = None

    @property
    def consumes(self) -> dict[str, tuple[str, ...]]:
        """Worker state -> the dock columns it needs (the dock's controllers, in launch order)."""
        return {spec.name: spec.consumes for spec in self.specs}

    @property
    def produces(self) -> dict[str, tuple[str, ...]]:
        """ "driver" and each worker state -> the columns it writes."""
        return {"driver": self.driver_produces, **{spec.name: spec.produces for spec in self.specs}}

    def spec(self, state: str) -> WorkerState:
        for spec in self.specs:
            if spec.name == state:
                return spec
        raise KeyError(f"recipe {self.name!r} has no state {state!r}; its states: {list(self.states)}")

    @property
    def launched_states(self) -> tuple[str, ...]:
        """States started together once the dock holds the iteration's batch (the driver's reads
        and the sampling rounds' states are not)."""
        rounds = self.sampling_rounds
        skip = (*rounds.states, rounds.read_state) if rounds else ()
        return tuple(spec.name for spec in self.specs if spec.group is not None and spec.name not in skip)

    @property
    def facts(self) -> WorkerState:
        """The driver's read of the samples' facts (states.SAMPLE_FACTS, its columns as this recipe
        writes them): what the iteration's record takes its rewards and response lengths from."""
        return self.spec(SAMPLE_FACTS.name)

    @property
    def training_states(self) -> tuple[str, ...]:
        """The launched states that train (the policy's update, the critic's): launched last."""
        return tuple(s for s in self.launched_states if self.spec(s).trains)

    @property
    def needs_rollout_engine(self) -> bool:
        return ROLLOUT.name in self.consumes

    @property
    def states(self) -> tuple[str, ...]:
        return tuple(self.consumes)

    @property
    def needs_critic(self) -> bool:
        return CRITIC.name in worker_groups(self.specs)

    @property
    def credits_turns(self) -> bool:
        """Whether the recipe can credit a multi-turn episode's turns apart (algorithm.credit: turn)."""
        return self.turn_credit_stage is not None or self.needs_critic

    @property
    def can_fuse_reward_advantage(self) -> bool:
        """Whether the reward state can run the advantage stage itself: the advantage reads only
        columns the reward writes, over whole prompt groups (GRPO, DAPO; not PPO's GAE, which needs
        the critic's values and whitens over the iteration)."""
        if "advantage" not in self.consumes or "reward" not in self.consumes or self.advantage_scope != "groups":
            return False
        return set(self.consumes["advantage"]) <= set(self.produces["reward"])


RECIPES: Registry[Recipe] = Registry("algorithm", field="algorithm.name")


def get_recipe(name: str) -> Recipe:
    return RECIPES.get(name)


ADVANTAGE_SCOPES = ("groups", "iteration")


def recomputes_old_logprobs(cfg: JobConfig) -> bool:
    """Whether the actor runs its own old-logprob pass (`actor_inference`) before the update
    (algorithm.recompute_old_logprobs). `auto` skips it exactly when the sampling policy is the
    training policy: one optimizer step per iteration and no stale samples; the engine takes the
    weights after every update (any resharding mode) and the actor's model runs in eval mode (no
    dropout), so the update's own forward pass gives the same logprobs."""
    algo = cfg.algorithm
    if algo.recompute_old_logprobs != "auto":
        return algo.recompute_old_logprobs == "always"
    # routing replay records the routing in this pass (its `never` is refused at validate)
    return algo.num_updates_per_iteration > 1 or cfg.dock.max_staleness > 0 or algo.routing_replay == "reference"


def job_recipe(cfg: JobConfig) -> Recipe:
    """The algorithm's recipe as this job runs it, less the passes its config makes redundant: the
    old-logprob pass (see `recomputes_old_logprobs`) and the reference when kl_coef is 0, with the
    advantage stage run by the reward state where it can be (unless JobConfig.ablations says not to), plus
    the reward model's state when a reward term is `model`, the reference pass on the actor
    ranks under LoRA, the routing column under algorithm.routing_replay `reference` and the engine's
    logprobs under rollout.return_logprobs. The one
    place the flow is derived: the dock's states, the trainer's workers and launches, the placement
    and the workers' inputs all come from it, so they agree."""
    recipe = get_recipe(cfg.algorithm.name)
    dropped = set()
    if ACTOR_INFERENCE.name in recipe.consumes and not recomputes_old_logprobs(cfg):
        dropped.add(ACTOR_INFERENCE.name)
    if REFERENCE_INFERENCE.name in recipe.consumes and recipe.reference_for_kl_only and cfg.algorithm.kl_coef == 0:
        dropped.add(REFERENCE_INFERENCE.name)
    recipe = without_states(recipe, dropped)
    algo = cfg.algorithm
    if cfg.agent is not None and (algo.credit == "turn" or (recipe.needs_critic and algo.gae_unit == "turn")):
        recipe = with_turns(recipe)  # before fusing: the advantage then reads the rollout's columns too
    if cfg.ablations.fuse_reward_advantage and recipe.can_fuse_reward_advantage:
        recipe = with_advantage_in_reward(recipe)
    if cfg.reward.model_term_index is not None:
        recipe = with_reward_model(recipe)
    if cfg.rollout.partial_rollout != "off" and ACTOR_INFERENCE.name in recipe.consumes:
        columns = AGENT_PARTIAL_ROLLOUT if cfg.agent is not None else PARTIAL_ROLLOUT
        recipe = with_partial_rollout(recipe, columns=columns)
        if cfg.rollout.importance_correction == "decoupled":
            recipe = with_importance_weight(recipe)
    if cfg.training.lora is not None:
        recipe = with_reference_on_actor(recipe)
    if cfg.agent is not None:
        recipe = with_agent(recipe)
    if cfg.algorithm.routing_replay == "reference" and ACTOR_INFERENCE.name in recipe.consumes:
        recipe = with_routing_replay(recipe)
    if cfg.rollout.return_logprobs:
        recipe = with_sampled_logprobs(recipe)
    return recipe


def with_sampled_logprobs(recipe: Recipe) -> Recipe:
    """`recipe` whose rollout also writes the engine's logprob of each sampled token, which the update
    reads to report the training-inference mismatch (rollout.return_logprobs)."""
    (sampled, _) = PARTIAL_ROLLOUT
    return with_update_column(recipe, writer=ROLLOUT.name, columns=(sampled,))


def with_routing_replay(recipe: Recipe) -> Recipe:
    """`recipe` whose old-logprob pass also writes the routing it took (`routed_experts`), which the
    update reads and routes by (algorithm.routing_replay `reference`)."""
    return with_update_column(recipe, writer=ACTOR_INFERENCE.name, columns=ROUTED_EXPERTS)


def with_agent(recipe: Recipe) -> Recipe:
    """`recipe` whose rollout writes multi-turn trajectories: the response tokens attended to beside
    the model's own, read by every state that reads the response, and the trajectory's counts, read
    by the reward state."""

    def change(spec: WorkerState) -> WorkerState:
        produces, consumes = spec.produces, spec.consumes
        if spec.name == ROLLOUT.name:  # an environment looks each sample's row up by its prompt_index
            produces += RESPONSE_ATTENTION + TRAJECTORY_COUNTS + TURNS
            consumes += PROMPT_INDEX
        if "response_mask" in spec.consumes:
            consumes += RESPONSE_ATTENTION
        if spec.name == REWARD_STATE.name:
            consumes += TRAJECTORY_COUNTS
        return replace(spec, consumes=consumes, produces=produces)

    return _with_specs(recipe, change)


def with_turns(recipe: Recipe) -> Recipe:
    """`recipe` whose advantage stage reads the episodes' turns (`turn_index`, `turn_rewards`): for
    `algorithm.credit: turn` its turn-level stage in place of the trajectory-level one, and for a critic's
    GAE by turn or with rewards per turn the same stage, which reads algorithm.credit and gae_unit."""
    assert recipe.credits_turns, f"recipe {recipe.name!r} has no turn-level advantage"
    stage = recipe.turn_credit_stage or recipe.advantage_stage
    recipe = _with_specs(
        recipe,
        lambda spec: replace(spec, consumes=spec.consumes + TURNS) if spec.name == ADVANTAGE_STATE.name else spec,
    )
    return replace(recipe, advantage_stage=stage)


def _with_specs(recipe: Recipe, change: Callable[[WorkerState], WorkerState]) -> Recipe:
    return replace(recipe, specs=tuple(change(spec) for spec in recipe.specs))


def with_reference_on_actor(recipe: Recipe) -> Recipe:
    """`recipe` whose reference pass runs on the actor ranks (their model with its LoRA adapters
    off) instead of reference ranks of its own."""
    return _with_specs(
        recipe, lambda spec: replace(spec, group=ACTOR) if spec.name == REFERENCE_INFERENCE.name else spec
    )


def with_partial_rollout(recipe: Recipe, *, columns: tuple[str, ...] = PARTIAL_ROLLOUT) -> Recipe:
    """`recipe` whose rollout also writes each token's sampling logprob and which policy version sampled
    which tokens (`columns`: how many leading tokens the older version sampled, rollout/partial.py, or
    an agent's per-token version, rollout/agent.py), which the old-logprob pass reads."""

    def change(spec: WorkerState) -> WorkerState:
        if spec.name == ACTOR_INFERENCE.name:
            return replace(spec, consumes=spec.consumes + POLICY_VERSION + columns)
        if spec.name == ROLLOUT.name:
            return replace(spec, produces=spec.produces + columns)
        return spec

    return _with_specs(recipe, change)


def with_importance_weight(recipe: Recipe) -> Recipe:
    """`recipe` whose old-logprob pass also writes each token's truncated importance weight, which the
    update weights the advantages with (rollout.importance_correction decoupled, algorithms/importance.py)."""
    return with_update_column(recipe, writer=ACTOR_INFERENCE.name, columns=(IMPORTANCE_WEIGHT,))


def with_update_column(recipe: Recipe, *, writer: str, columns: tuple[str, ...]) -> Recipe:
    """`recipe` whose `writer` state also writes `columns`, which its update state reads."""

    def change(spec: WorkerState) -> WorkerState:
        if spec.name == writer:
            return replace(spec, produces=spec.produces + columns)
        if spec.name == recipe.update_state:
            return replace(spec, consumes=spec.consumes + columns)
        return spec

    return _with_specs(recipe, change)


def with_advantage_in_reward(recipe: Recipe) -> Recipe:
    """`recipe` whose reward state also computes the advantages of the groups it scores (the
    recipe must `can_fuse_reward_advantage`): the advantage state is gone, and the reward state
    writes the advantage stage's columns plus those of its own that a remaining state still reads
    (DAPO's `score`; GRPO's `reward` only the advantage read, so it is no longer written)."""
    assert recipe.can_fuse_reward_advantage, f"recipe {recipe.name!r} cannot fuse reward and advantage"
    advantage = recipe.spec(ADVANTAGE_STATE.name)
    specs = [spec for spec in recipe.specs if spec is not advantage]
    read = {column for spec in specs for column in spec.consumes}
    reward = recipe.spec(REWARD_STATE.name)
    fused = replace(reward, produces=tuple(c for c in reward.produces if c in read) + advantage.produces)
    return replace(recipe, specs=tuple(fused if spec is reward else spec for spec in specs), advantage_in_reward=True)


def with_reward_model(recipe: Recipe) -> Recipe:
    """`recipe` with the `reward_model` state, which reads prompt + response and writes `rm_score`
    for the reward state to read; it runs wherever the reward state does (in DAPO's sampling rounds
    too, whose filter reads the reward). A recipe without a reward state (DPO) is returned as is."""
    if REWARD_STATE.name not in recipe.consumes:
        return recipe
    specs: list[WorkerState] = []
    for spec in recipe.specs:
        if spec.name == REWARD_STATE.name:  # the specs' order is the launch order: the reward model before its reader
            specs.append(REWARD_MODEL)
            spec = replace(spec, consumes=spec.consumes + RM_SCORE)
        specs.append(spec)
    rounds = recipe.sampling_rounds
    if rounds is not None and REWARD_STATE.name in rounds.states:
        rounds = replace(rounds, states=(*rounds.states, REWARD_MODEL.name))
    return replace(recipe, specs=tuple(specs), sampling_rounds=rounds)


def without_states(recipe: Recipe, states: set[str]) -> Recipe:
    """`recipe` without `states`, whose columns no remaining state then reads."""
    if not states:
        return recipe
    columns = {column for spec in recipe.specs if spec.name in states for column in spec.produces}
    return replace(
        recipe,
        specs=tuple(
            replace(spec, consumes=tuple(c for c in spec.consumes if c not in columns))
            for spec in recipe.specs
            if spec.name not in states
        ),
    )


def register_recipe(recipe: Recipe) -> Recipe:
    """Register `recipe`; it must be in the contract's algorithm catalogue and agree with it (the
    operator counts devices from the catalogue without importing the runtime)."""
    if recipe.advantage_scope not in ADVANTAGE_SCOPES:
        raise ValueError(
            f"recipe {recipe.name!r}: advantage_scope {recipe.advantage_scope!r} is not one of {ADVANTAGE_SCOPES}"
        )
    traits = CATALOGUE.get(recipe.name)
    if traits is None:
        raise ValueError(f"recipe {recipe.name!r} is not in rldock.contract.algorithms.CATALOGUE")
    if SAMPLE_FACTS.name not in recipe.consumes:
        raise ValueError(f"recipe {recipe.name!r} has no {SAMPLE_FACTS.name} state: the driver reads its facts there")
    if (traits.needs_critic, traits.needs_rollout, traits.credits_turns) != (
        recipe.needs_critic,
        recipe.needs_rollout_engine,
        recipe.credits_turns,
    ):
        raise ValueError(f"recipe {recipe.name!r} disagrees with the algorithm catalogue: {traits}")
    return RECIPES.register(recipe.name)(recipe)


# --- advantage stages ----------------------------------------------------------------------------


def group_advantage_stage(estimator: str) -> AdvantageStage:
    """Outcome advantages from whole groups of rewards by a registered estimator: (B,) per sample."""
    fn = get_advantage_estimator(estimator)

    def stage(batch, algo, generator):
        return {"advantage": fn(batch["reward"], algo.num_responses_per_prompt)}  # (B,)

    return stage


def batch_advantage_stage(estimator: str) -> AdvantageStage:
    """Outcome advantages normalised over the iteration's whole batch by a registered estimator
    (REINFORCE++), each response weighted by its tokens: (B,) per sample."""
    fn = get_advantage_estimator(estimator)

    def stage(batch, algo, generator):
        token_counts = batch["response_mask"].sum(dim=1)  # (B,)
        return {"advantage": fn(batch["reward"], algo.num_responses_per_prompt, token_counts=token_counts)}

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
    group_size = algo.num_responses_per_prompt
    advantages = get_advantage_estimator("grpo")(batch["reward"], group_size)  # (B,)
    keep = informative_groups(batch["score"], group_size).repeat_interleave(group_size)  # (B,)
    return {"advantage": torch.where(keep, advantages, torch.zeros_like(advantages))}


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
        (REFERENCE_INFERENCE, PREFERENCE_UPDATE, replace(SAMPLE_FACTS, consumes=RESPONSE_LENGTH)),
        advantage_stage=None,
        policy_loss=None,
        driver_batch="preference_pairs",
        driver_produces=PROMPT + RESPONSE + RESPONSE_LENGTH,
        update_state=PREFERENCE_UPDATE.name,
        reference_for_kl_only=False,
    )
)
