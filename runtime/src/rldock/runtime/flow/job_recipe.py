"""The flow a job's config runs: its algorithm's recipe (catalogue.py) rewritten for the config, less
the passes the config makes redundant and with the states and columns its sections add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from rldock.config.job import JobConfig
from rldock.runtime.algorithms.importance import IMPORTANCE_WEIGHT
from rldock.runtime.flow.catalogue import get_recipe
from rldock.runtime.flow.columns import (
    AGENT_PARTIAL_ROLLOUT,
    EPISODE,
    EPISODE_SHARE,
    PARTIAL_ROLLOUT,
    POLICY_VERSION,
    PROMPT_DRAW,
    PROMPT_INDEX,
    PROMPT_ROW,
    RESPONSE_ATTENTION,
    RM_SCORE,
    ROUTED_EXPERTS,
    TRAJECTORY_COUNTS,
    TURNS,
)
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import (
    ACTOR,
    ACTOR_INFERENCE,
    ADVANTAGE_STATE,
    REFERENCE_INFERENCE,
    REWARD_MODEL,
    REWARD_STATE,
    ROLLOUT,
    SAMPLE_FACTS,
    WorkerState,
)


def recomputes_old_logprobs(cfg: JobConfig) -> bool:
    """Whether the actor runs its own old-logprob pass (`actor_inference`) before the update
    (algorithm.recompute_old_logprobs). `auto` skips it exactly when the sampling policy is the
    training policy: one optimizer step per iteration and no stale samples; the engine takes the
    weights after every update (any resharding mode) and the actor's model runs in eval mode (no
    dropout), so the update's own forward pass gives the same logprobs."""
    algo = cfg.algorithm
    if algo.recompute_old_logprobs != "auto":
        return algo.recompute_old_logprobs == "always"
    # routing replay records the routing in this pass, and the rollout correction compares the engine's
    # logprobs with it (their `never` is refused at validate)
    return (
        algo.num_updates_per_iteration > 1
        or cfg.dock.max_staleness > 0
        or algo.routing_replay == "reference"
        or measures_mismatch(cfg)
    )


def measures_mismatch(cfg: JobConfig) -> bool:
    """Whether the old-logprob pass compares the engine's logprobs with its own (the `mismatch/` metrics):
    to correct the update (algorithm.rollout_correction) or to hold the job to a budget (monitoring.mismatch)."""
    return cfg.algorithm.rollout_correction is not None or cfg.monitoring.mismatch is not None


def job_recipe(cfg: JobConfig) -> Recipe:
    """The algorithm's recipe as this job runs it, less the passes its config makes redundant: the
    old-logprob pass (see `recomputes_old_logprobs`) and the reference when kl_coef is 0, with the
    advantage stage run by the reward state where it can be (unless JobConfig.ablations says not to), plus
    the reward model's state when a reward term is `model`, the reference pass on the actor
    ranks under LoRA, the routing column under algorithm.routing_replay `reference`, the engine's
    logprobs under rollout.return_logprobs and the mismatch's columns (`measures_mismatch`). The one
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
    if cfg.rows_per_episode > 1:
        recipe = with_segments(recipe)  # before fusing: the fused reward then writes the shares too
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
    if cfg.rollout.partial_rollout == "carry":
        recipe = with_carried_groups(recipe)
    if cfg.algorithm.routing_replay == "reference" and ACTOR_INFERENCE.name in recipe.consumes:
        recipe = with_routing_replay(recipe)
    if cfg.rollout.return_logprobs:
        recipe = with_sampled_logprobs(recipe)
    if measures_mismatch(cfg) and ACTOR_INFERENCE.name in recipe.consumes:
        recipe = with_engine_logprobs(recipe)
        if cfg.algorithm.rollout_correction is not None:
            recipe = with_importance_weight(recipe)
    if cfg.rollout.pool is not None and not cfg.rollout.pool.actors_generate:
        recipe = with_rollout_on_pool(recipe)
    return recipe


def with_rollout_on_pool(recipe: Recipe) -> Recipe:
    """`recipe` whose rollout the rollout pool's engines run alone (rollout.pool.actors_generate false): no
    actor rank generates, so no device's phase schedule has a rollout turn."""
    return _with_specs(recipe, lambda spec: replace(spec, runs_on="pool") if spec.name == ROLLOUT.name else spec)


def with_engine_logprobs(recipe: Recipe) -> Recipe:
    """`recipe` whose rollout writes the engine's logprob of each sampled token, which the old-logprob pass
    reads beside its own (`measures_mismatch`; the correction's weight, algorithms/rollout_correction.py)."""
    (sampled, _) = PARTIAL_ROLLOUT

    def change(spec: WorkerState) -> WorkerState:
        if spec.name == ROLLOUT.name and sampled not in spec.produces:  # rollout.return_logprobs writes it too
            return replace(spec, produces=spec.produces + (sampled,))
        if spec.name == ACTOR_INFERENCE.name and sampled not in spec.consumes:  # partial rollout reads it too
            return replace(spec, consumes=spec.consumes + (sampled,))
        return spec

    return _with_specs(recipe, change)


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
        if spec.name == ROLLOUT.name:  # an environment checks answers against the sample's row
            produces += RESPONSE_ATTENTION + TRAJECTORY_COUNTS + TURNS
            consumes += PROMPT_INDEX + PROMPT_ROW
        if "response_mask" in spec.consumes:
            consumes += RESPONSE_ATTENTION
        if spec.name == REWARD_STATE.name:
            consumes += TRAJECTORY_COUNTS
        return replace(spec, consumes=consumes, produces=produces)

    return _with_specs(recipe, change)


def with_carried_groups(recipe: Recipe) -> Recipe:
    """`recipe` whose rollout writes groups into other rows than the ones it was handed (carried episodes,
    rollout/agent_carry.py): it reads each group's draw number too, and writes it with the group's prompt,
    so that the driver's read of the facts names the groups that trained (the prompt ledger)."""

    def change(spec: WorkerState) -> WorkerState:
        return replace(spec, consumes=spec.consumes + PROMPT_DRAW) if spec.name == ROLLOUT.name else spec

    return _with_specs(recipe, change)


def with_segments(recipe: Recipe) -> Recipe:
    """`recipe` whose episodes are several rows each (a harness's segments, agent.max_segments): the driver
    writes each row's `episode`, which the reward (it scores each episode once), the advantage and the
    driver's read of the facts count episodes by; the advantage writes each row's `episode_share`, which the
    update's loss aggregation counts episodes by."""
    update = recipe.update_state

    def change(spec: WorkerState) -> WorkerState:
        produces, consumes = spec.produces, spec.consumes
        if spec.name in (REWARD_STATE.name, ADVANTAGE_STATE.name, SAMPLE_FACTS.name):
            consumes += EPISODE
        if spec.name == ADVANTAGE_STATE.name:
            consumes += tuple(c for c in ("response_mask",) if c not in consumes)
            produces += EPISODE_SHARE
        if spec.name == update:
            consumes += EPISODE_SHARE
        return replace(spec, consumes=consumes, produces=produces)

    return replace(_with_specs(recipe, change), driver_produces=recipe.driver_produces + EPISODE)


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
    specs = tuple(change(spec) for spec in recipe.specs)
    for spec in specs:  # two changes adding one column would have the dock wait for it twice, forever
        for columns in (spec.consumes, spec.produces):
            assert len(set(columns)) == len(columns), f"state {spec.name!r} names a column twice: {columns}"
    return replace(recipe, specs=specs)


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
    update weights the advantages with (rollout.importance_correction decoupled, algorithms/importance.py;
    algorithm.rollout_correction, algorithms/rollout_correction.py)."""
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
