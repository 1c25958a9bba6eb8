"""The flow a job runs (`job_recipe`): the algorithm's recipe less the passes its config makes
redundant, closed (every column a state reads is written by the driver or a remaining state)."""

from __future__ import annotations

import pytest

from rldock.config.job import JobConfig
from rldock.config.problems import find_problems
from rldock.config.reward import RewardSpec
from rldock.runtime.flow.catalogue import get_recipe
from rldock.runtime.flow.job_recipe import job_recipe, recomputes_old_logprobs


def _cfg(name="grpo", *, dock=None, **algorithm) -> JobConfig:
    n = 2 if name == "dpo" else 4
    return JobConfig(
        iterations=1,
        model={"path": "/m", "builder": "tiny-qwen2"},
        dock=dock or {},
        checkpoint={"interval": 1},
        algorithm={
            "name": name,
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": n,
            "max_prompt_length": 4,
            "max_response_length": 4,
            "learning_rate": 1e-3,
            **algorithm,
        },
    )


def _closed(recipe) -> bool:
    written = {c for cols in recipe.produces.values() for c in cols}
    return all(c in written for cols in recipe.consumes.values() for c in cols)


@pytest.mark.parametrize(
    "cfg, recomputes",
    [
        (_cfg(), False),
        (_cfg(recompute_old_logprobs="always"), True),
        (_cfg(num_updates_per_iteration=2), True),
        (_cfg(dock={"max_staleness": 1}), True),
        (_cfg(recompute_old_logprobs="never"), False),
    ],
)
def test_auto_recomputes_only_when_the_sampling_policy_is_not_the_training_one(cfg, recomputes):
    assert recomputes_old_logprobs(cfg) is recomputes
    recipe = job_recipe(cfg)
    assert ("actor_inference" in recipe.launched_states) is recomputes
    assert ("old_logprobs" in recipe.consumes["update"]) is recomputes
    assert _closed(recipe)


@pytest.mark.parametrize("name", ["grpo", "ppo", "pf_ppo", "dapo"])
def test_kl_coef_zero_drops_the_reference_state(name):
    recipe = job_recipe(_cfg(name, kl_coef=0.0))
    assert "reference" not in recipe.consumes and "ref_logprobs" not in recipe.consumes["update"]
    assert _closed(recipe)
    assert "reference" in job_recipe(_cfg(name, kl_coef=0.01)).consumes


def test_dpo_keeps_its_reference_whatever_the_kl_coef():
    assert job_recipe(_cfg("dpo", kl_coef=0.0)).consumes == get_recipe("dpo").consumes


def test_never_with_several_updates_or_stale_samples_is_a_problem_naming_both_fields():
    problems = find_problems(_cfg(recompute_old_logprobs="never", num_updates_per_iteration=2))
    assert [p.path for p in problems] == ["algorithm.recompute_old_logprobs"]
    assert "num_updates_per_iteration" in problems[0].message
    problems = find_problems(_cfg(recompute_old_logprobs="never", dock={"max_staleness": 2}))
    assert [p.path for p in problems] == ["algorithm.recompute_old_logprobs"]
    assert "dock.max_staleness" in problems[0].message
    assert find_problems(_cfg(recompute_old_logprobs="never")) == []


def _with_model_term(cfg: JobConfig) -> JobConfig:
    return cfg.model_copy(
        update={"reward": RewardSpec(terms=[{"name": "model", "path": "/rm"}, {"name": "digit_match", "weight": 0.1}])}
    )


@pytest.mark.parametrize("name", ["grpo", "ppo", "pf_ppo", "dapo"])
def test_a_model_term_adds_the_reward_model_state_before_the_reward(name):
    plain = job_recipe(_cfg(name))
    assert "reward_model" not in plain.consumes and "rm_score" not in plain.consumes["reward"]
    recipe = job_recipe(_with_model_term(_cfg(name)))
    assert recipe.consumes["reward_model"] == ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
    assert recipe.produces["reward_model"] == ("rm_score",)
    assert recipe.consumes["reward"] == plain.consumes["reward"] + ("rm_score",)
    states = list(recipe.consumes)
    assert states.index("reward_model") == states.index("reward") - 1
    assert _closed(recipe)
    rounds = recipe.sampling_rounds
    if rounds is None:
        assert "reward_model" in recipe.launched_states
    else:  # DAPO: the filter reads the reward, so the reward model runs in every sampling round
        assert rounds.states == ("rollout", "reward", "reward_model")
        assert "reward_model" not in recipe.launched_states


def test_a_model_term_adds_nothing_to_dpo_which_has_no_reward_state():
    assert job_recipe(_with_model_term(_cfg("dpo"))).consumes == get_recipe("dpo").consumes


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_partial_rollout_has_the_rollout_write_what_the_old_logprob_pass_reads(name):
    cfg = JobConfig(
        **{
            **_cfg(name, dock={"max_staleness": 1}).model_dump(),
            "training": {"mode": "async"},
            "rollout": {"partial_rollout": "resume", "max_tokens_per_round": 2},
        }
    )
    assert find_problems(cfg) == []
    recipe = job_recipe(cfg)
    assert {"sampled_logprobs", "prefix_length", "policy_version"} <= set(recipe.consumes["actor_inference"])
    assert {"sampled_logprobs", "prefix_length"} <= set(recipe.produces["rollout"])
    assert _closed(recipe)
    off = job_recipe(_cfg(name, dock={"max_staleness": 1}))
    assert "sampled_logprobs" not in off.consumes["actor_inference"] + off.produces["rollout"]


def test_an_agents_partial_rollout_writes_each_tokens_version_for_the_old_logprob_pass():
    cfg = JobConfig(
        **{
            **_cfg("grpo", dock={"max_staleness": 1}).model_dump(),
            "training": {"mode": "async"},
            "rollout": {"partial_rollout": "resume", "max_tokens_per_round": 2, "importance_correction": "decoupled"},
            "agent": {"tools": [{"name": "calculator"}]},
        }
    )
    recipe = job_recipe(cfg)
    assert "importance_weight" in recipe.consumes["update"]  # the decoupled correction, written by the pass
    assert {"sampled_logprobs", "token_policy_version", "policy_version"} <= set(recipe.consumes["actor_inference"])
    assert {"sampled_logprobs", "token_policy_version"} <= set(recipe.produces["rollout"])
    assert "prefix_length" not in recipe.produces["rollout"]
    assert _closed(recipe)


@pytest.mark.parametrize(
    "name, reward_writes, advantage_reads",
    [
        ("grpo", ("score", "advantage"), ("reward",)),  # the score: what the driver reads (sample_facts)
        ("dapo", ("score", "advantage"), ("reward", "score")),  # DAPO zeroes groups of equal scores
    ],
)
def test_group_advantages_are_fused_into_the_reward_state(name, reward_writes, advantage_reads):
    fused = job_recipe(_cfg(name))
    assert fused.advantage_in_reward and "advantage" not in fused.consumes and "advantage" not in fused.produces
    assert fused.produces["reward"] == reward_writes and _closed(fused)
    # DAPO's sampling rounds run the reward, so the kept groups come out of them with their advantages.
    assert "advantage" not in fused.launched_states
    separate = job_recipe(_cfg(name).with_ablations(fuse_reward_advantage=False))
    assert not separate.advantage_in_reward and "advantage" in separate.launched_states
    assert separate.consumes["advantage"] == advantage_reads and "reward" in separate.produces["reward"]
    assert _closed(separate)
    assert _closed(job_recipe(_with_model_term(_cfg(name))))


@pytest.mark.parametrize("name", ["ppo", "pf_ppo", "dpo"])
def test_fusing_is_ignored_where_the_advantage_needs_more_than_the_reward(name):
    # PPO's GAE reads the critic's values and whitens over the iteration; DPO has no advantage.
    assert not get_recipe(name).can_fuse_reward_advantage
    assert (
        job_recipe(_cfg(name)).consumes == job_recipe(_cfg(name).with_ablations(fuse_reward_advantage=False)).consumes
    )
    assert find_problems(_cfg(name)) == []


def _agent_cfg(name: str, **algorithm) -> JobConfig:
    data = _cfg(name, **algorithm).model_dump(exclude_unset=True)
    data.update(
        agent={"environment": {"name": "feedback"}, "max_turns": 3}, reward={"terms": [{"name": "environment"}]}
    )
    return JobConfig.model_validate(data)


@pytest.mark.parametrize("name", ["grpo", "gspo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_turn_credit_reads_the_rollouts_turns_in_an_advantage_state_of_its_own(name):
    trajectory, turn = job_recipe(_agent_cfg(name)), job_recipe(_agent_cfg(name, credit="turn"))
    assert turn.advantage_stage is get_recipe(name).turn_credit_stage
    assert {"turn_index", "turn_rewards"} <= set(turn.consumes["advantage"]) and _closed(turn)
    assert not turn.advantage_in_reward  # the reward state cannot run it: the turns come from the rollout
    assert trajectory.advantage_stage is get_recipe(name).advantage_stage
    assert "turn_index" not in trajectory.consumes.get("advantage", ())


@pytest.mark.parametrize("name", ["ppo", "pf_ppo"])
@pytest.mark.parametrize(
    ("algorithm", "reads_turns"), [({}, False), ({"gae_unit": "turn"}, True), ({"credit": "turn"}, True)]
)
def test_a_critics_gae_reads_the_turns_where_its_unit_or_credit_is_the_turn(name, algorithm, reads_turns):
    recipe = job_recipe(_agent_cfg(name, **algorithm))
    assert recipe.advantage_stage is get_recipe(name).advantage_stage and _closed(recipe)
    assert ("turn_index" in recipe.consumes["advantage"]) == reads_turns
    assert "value_mask" in recipe.consumes["critic_update"]
    assert "response_attention_mask" in recipe.consumes["critic_inference"]


def _harness_cfg(max_segments: int, name: str = "grpo") -> JobConfig:
    data = _cfg(name).model_dump(exclude_unset=True)
    return JobConfig(**data, agent={"harness": "h.py:run", "max_segments": max_segments})


@pytest.mark.parametrize("name", ["grpo", "dapo", "rloo", "reinforce_plus_plus", "gspo"])
def test_a_harness_with_segments_counts_episodes_by_the_drivers_episode_column(name):
    recipe = job_recipe(_harness_cfg(4, name))
    assert "episode" in recipe.driver_produces and _closed(recipe)
    consumes = recipe.consumes
    assert "episode" in consumes["reward"] and "episode" in consumes["sample_facts"]
    assert "episode_share" in consumes[recipe.update_state]
    # written by the advantage stage, wherever it runs (fused into the reward state or its own)
    assert any("episode_share" in columns for columns in recipe.produces.values())


def test_one_row_per_episode_adds_no_column():
    recipe = job_recipe(_harness_cfg(1))
    assert "episode" not in recipe.driver_produces
    assert not any("episode" in c for columns in recipe.consumes.values() for c in columns)


def test_a_carry_rollout_reads_each_groups_draw_number_to_write_it_with_the_group():
    """Carried episodes are written into other rows than the ones the rollout was handed: the rollout reads the
    groups' draw numbers (prompt_draw) with their prompts, so the driver's read of the facts (the prompt ledger)
    names the groups that trained, not the rows' fresh ones. Other rollouts leave the driver's column alone."""
    carry = JobConfig(
        **{
            **_cfg().model_dump(exclude_unset=True),
            "agent": {"tools": [{"name": "calculator"}]},
            "rollout": {"partial_rollout": "carry", "importance_correction": "behaviour"},
        }
    )
    assert "prompt_draw" in job_recipe(carry).consumes["rollout"]
    assert "prompt_draw" not in job_recipe(_cfg()).consumes["rollout"]
    assert "prompt_draw" in job_recipe(carry).consumes["sample_facts"]
