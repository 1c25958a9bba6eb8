"""`algorithm`: what is optimised and how (docs/algorithms/): the algorithm's name, the batch (G prompts x N
responses), the KL, the clip and each algorithm's own settings (ppo, pf_ppo, dapo, gspo, dpo), with the checks
that need more than one field (`problems`, rldock.config.problems.SECTION_CHECKS): DAPO's, DPO's, turn credit's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator, Field, model_validator

from rldock.config.problem import Problem
from rldock.config.rollout_correction import RolloutCorrectionSpec
from rldock.config.section import Spec, bare_off
from rldock.contract.algorithms import AlgorithmName, credits_turns, needs_critic

if TYPE_CHECKING:
    from rldock.config.job import JobConfig


class PPOSpec(Spec):
    """PPO's critic and GAE (used by `ppo` and `pf_ppo`; ignored by the other algorithms)."""

    gamma: float = Field(default=1.0, ge=0, le=1, description="GAE discount over response tokens.")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda: 0 is one-step TD, 1 is Monte Carlo.")
    value_clip: float = Field(
        default=0.2,
        gt=0,
        description="The critic's new values may move at most this far from the values it predicted "
        "at sampling time before the clipped value loss stops pulling them.",
    )
    critic_learning_rate: float = Field(default=1e-3, ge=0, description="Critic AdamW learning rate.")
    whiten_advantages: bool = Field(
        default=True,
        description="Normalise the GAE advantages to mean 0, std 1 over the response tokens of the iteration's batch.",
    )


class PFPPOSpec(Spec):
    """PF-PPO's policy filtration (arXiv 2409.06957): which responses train the policy, by reward."""

    mode: Literal["best_of_n", "best_random", "best_worst", "pow"] = Field(
        default="best_worst",
        description="`best_of_n`: only each prompt's highest-reward response; `best_random`: the best "
        "and one other drawn at random; `best_worst`: the best and the worst; `pow`: every response, "
        "weighted by |reward| ** `power`.",
    )
    power: float = Field(default=2.0, gt=0, description="Exponent of the `pow` mode's weights.")


class DAPOSpec(Spec):
    """DAPO's knobs (arXiv 2503.14476; used by `dapo`, ignored by the other algorithms)."""

    clip_ratio_low: float = Field(default=0.2, gt=0, lt=1, description="Lower ratio clip: 1 - low.")
    clip_ratio_high: float = Field(
        default=0.28,
        gt=0,
        description="Upper ratio clip: 1 + high (clip-higher; larger than `clip_ratio_low` keeps exploration).",
    )
    dynamic_sampling: bool = Field(
        default=True,
        description="Drop prompt groups whose unshaped scores (accuracy, before overlong shaping) are all "
        "equal (no gradient) and refill their slots with fresh prompts until the batch holds G groups "
        "with differing scores.",
    )
    max_sampling_rounds: int = Field(
        default=4,
        ge=1,
        description="Most sampling rounds per iteration for dynamic sampling (the first samples G prompts, "
        "each later one only the slots of dropped groups); slots still without a kept group after them "
        "keep their last dropped group (advantage 0) and the shortfall is logged.",
    )
    overlong_buffer_length: int = Field(
        default=0,
        ge=0,
        description="Soft overlong punishment: over the last this many tokens before max_response_length "
        "the reward is lowered linearly up to `overlong_penalty_factor`; 0 disables.",
    )
    overlong_penalty_factor: float = Field(default=1.0, ge=0, description="Largest overlong penalty.")


class GSPOSpec(Spec):
    """GSPO's sequence-ratio clip (arXiv 2507.18071; used by `gspo`, ignored by the other algorithms)."""

    clip_ratio_low: float = Field(
        default=3e-4,
        gt=0,
        lt=1,
        description="Lower clip of the sequence ratio s = (pi/pi_old)^(1/|y|): 1 - low (the paper's 3e-4; s is a "
        "geometric mean over the response's tokens, so its range is far narrower than a token ratio's).",
    )
    clip_ratio_high: float = Field(
        default=4e-4, gt=0, description="Upper clip of the sequence ratio: 1 + high (the paper's 4e-4)."
    )


class DPOSpec(Spec):
    """DPO's knobs (arXiv 2305.18290; used by `dpo`). Pairs come from the data: with the `addition`
    generator chosen = the sum, rejected = a wrong one; with files the `data.chosen_key` and
    `data.rejected_key` columns. algorithm.num_responses_per_prompt must be 2."""

    beta: float = Field(default=0.1, gt=0, description="Strength of the implicit KL to the reference policy.")
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5, description="Assumed share of flipped preference labels (conservative DPO)."
    )


class AlgorithmSpec(Spec):
    """The RL algorithm and its hyper-parameters (the paper's G, N, PL, SL)."""

    name: AlgorithmName = Field(
        default="grpo",
        description="RL algorithm: `grpo` (group-normalised advantages), `ppo` (critic worker and "
        "GAE), `pf_ppo` (PPO with policy filtration by reward), `dapo`, `dpo`, `rloo` (leave-one-out "
        "baseline), `reinforce_plus_plus` (batch-normalised reward), `reinforce_plus_plus_baseline` (group "
        "mean baseline, batch-normalised), `gspo` (sequence-level ratio and clip). See docs/algorithms/.",
    )
    num_prompts_per_iteration: int = Field(
        ge=1, description="G: prompts drawn per iteration (the global batch, in prompts)."
    )
    num_responses_per_prompt: int = Field(
        ge=2, description="N: responses sampled per prompt; they form one GRPO group."
    )
    max_prompt_length: int = Field(
        ge=1,
        description="PL: most prompt tokens (after the chat template, with BOS); longer prompts are "
        "dropped from the prompt set and counted (`data/dropped_prompts`), never cut.",
    )
    max_response_length: int = Field(ge=1, description="SL: most tokens generated per response.")
    learning_rate: float = Field(ge=0, description="Actor AdamW learning rate.")
    clip_ratio: float = Field(default=0.2, gt=0, description="PPO ratio clip epsilon.")
    clip_ratio_c: float | None = Field(
        default=3.0,
        gt=1,
        description="Dual-clip (arXiv 1912.09729) of the PPO-family losses (`grpo`, `ppo`, `pf_ppo`, `dapo`): "
        "a token with negative advantage A loses at most -A * clip_ratio_c however far its ratio to the "
        "sampling policy grew (off-policy data: several updates per iteration, stale or partial rollouts). "
        "3 as verl; null turns it off.",
    )
    kl_coef: float = Field(
        default=0.04,
        ge=0,
        description="Weight of the KL penalty to the reference policy. Unset under `dapo` it is 0 (the DAPO paper "
        "drops the KL term, and a kl_coef > 0 there is a config problem).",
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        default="k3",
        description="Per-token KL estimator (Schulman 2020): `k3` = r - log r - 1 (>= 0, GRPO's), `k1` = -log r.",
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = (
        Field(
            default="token_mean",
            description="How the policy loss and the KL term become one scalar over the update's batch (unset under "
            "`gspo` it is `seq_mean_token_mean`, GSPO's objective), "
            "as verl's `loss_agg_mode`: `token_mean` every valid token counts the same; "
            "`seq_mean_token_mean` each response's token mean, then the mean over responses; `seq_mean_token_sum` "
            "each response's token sum, then the mean over responses; `seq_mean_token_sum_norm` the sum over "
            "responses of each response's token sum divided by max_response_length (Dr. GRPO). Responses with no "
            "token are left out; PF-PPO's weights weight each response's tokens. See docs/algorithms/policy-losses.md.",
        )
    )
    kl_clamp: float | None = Field(
        default=10.0,
        gt=0,
        description="Bound on each token's `k3` KL estimate (it grows like e^(log ratio)); 10 as verl; null "
        "leaves it unbounded (the log ratio itself is clamped to +-20 nats either way).",
    )
    num_updates_per_iteration: int = Field(
        default=1, ge=1, description="Optimizer steps per iteration; the batch is split into this many mini-batches."
    )
    recompute_old_logprobs: Literal["auto", "always", "never"] = Field(
        default="auto",
        description="Where the update's old (sampling-policy) logprobs come from. `always`: a separate "
        "inference pass of the actor (`actor_inference`) before the update. `never`: the update's own "
        "forward pass, detached (the ratio is exactly 1 on the first optimizer step). `auto`: `never` "
        "when that is exact, i.e. when the policy that sampled the responses is the policy that trains: "
        "num_updates_per_iteration is 1 and dock.max_staleness is 0 (the engine takes the weights after "
        "every update, whatever training.resharding; the actor runs its model without dropout), "
        "otherwise `always`. `never` with more than one update or a staleness bound is an error.",
    )
    routing_replay: Annotated[Literal["off", "rollout", "reference"], BeforeValidator(bare_off)] = Field(
        default="off",
        description="MoE models: which routing the update's forward uses (routing replay, R3: arXiv "
        "2510.11370). `off`: the routers choose anew. `reference`: the old-logprob pass (`actor_inference`, run "
        "whenever this is set) records each token's experts per layer, stored in the dock as `routed_experts` "
        "(B, prompt + response length, layers, top_k), and every forward of the update routes by them, the "
        "router's probabilities of the recorded experts still weighting their outputs (so the router trains); "
        "the update's routing then stays the one its old logprobs were computed with while its steps move the "
        "weights. `rollout`: the inference engine's routing; vLLM returns it only under its Model Runner V2 "
        "(Triton, GPU) and rldock's rollout does not collect it yet, so it is refused: use `reference`.",
    )

    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    credit: Literal["trajectory", "turn"] = Field(
        default="trajectory",
        description="Where a multi-turn episode's rewards sit (docs/algorithms/turn-credit.md). `trajectory`: "
        "the whole reward on the episode's last turn, one advantage for all of it (the critic-free algorithms) "
        "or the reward on its last model token (PPO's GAE). `turn`: each turn keeps the reward for its step "
        "(the environment's, or what a harness posted after it) and the rest of the reward goes on the last "
        "turn; `grpo`, `gspo`, `rloo`, `reinforce_plus_plus` and `reinforce_plus_plus_baseline` then give each "
        "turn the return from it onwards (discounted by `turn_discount`) against a baseline of the group's "
        "whole-episode returns, and `ppo` and `pf_ppo` put each turn's reward on its last model token. `turn` "
        "needs agent.environment or a harness, and an `environment` reward term of weight 1 that sums the steps.",
    )
    turn_discount: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="With `credit: turn` under a critic-free algorithm: the discount per turn of the return "
        "from a turn onwards, G_k = sum_j>=k turn_discount^(j-k) r_j.",
    )
    gae_unit: Literal["token", "turn"] = Field(
        default="token",
        description="The step of `ppo`'s and `pf_ppo`'s GAE (docs/algorithms/ppo.md#multi-turn-episodes). "
        "`token`: each model token, the tools' and the environment's tokens skipped (no value trained or "
        "bootstrapped through them). `turn`: each model turn, its value the critic's at its first token, its "
        "reward the sum of its rewards, gamma and lambda per turn, its advantage on every token of the turn "
        "(needs agent).",
    )
    rollout_correction: RolloutCorrectionSpec | None = Field(
        default=None,
        description="Correct the train-inference mismatch (docs/algorithms/rollout-correction.md): the rollout keeps "
        "the engine's logprob of each sampled token, the old-logprob pass (run whenever this is set) recomputes "
        "it, the update's ratio is against the trainer's and each token's advantage is weighted by the correction "
        "of the two; the `mismatch/` metrics report the gap every iteration. Unset: no correction.",
    )
    ppo: PPOSpec = Field(default_factory=PPOSpec, description="Critic and GAE settings of `ppo` and `pf_ppo`.")
    pf_ppo: PFPPOSpec = Field(default_factory=PFPPOSpec, description="Policy filtration settings of `pf_ppo`.")
    dapo: DAPOSpec = Field(
        default_factory=DAPOSpec, description="Clip-higher, dynamic sampling and overlong shaping of `dapo`."
    )
    dpo: DPOSpec = Field(default_factory=DPOSpec, description="Preference loss settings of `dpo`.")
    gspo: GSPOSpec = Field(default_factory=GSPOSpec, description="Sequence-ratio clip of `gspo`.")

    @model_validator(mode="before")
    @classmethod
    def _algorithm_defaults(cls, data):
        """Defaults that depend on the algorithm; an explicit value always stays. DAPO's kl_coef is 0,
        not 0.04 (sec. 2.3 of the paper; `problems.py` reports one set above 0). GSPO's objective is
        a mean over responses (eq. 5), so its loss_aggregation is `seq_mean_token_mean`."""
        if not isinstance(data, dict):
            return data
        if data.get("name") == "dapo" and "kl_coef" not in data:
            data = {**data, "kl_coef": 0.0}
        if data.get("name") == "gspo" and "loss_aggregation" not in data:
            data = {**data, "loss_aggregation": "seq_mean_token_mean"}
        return data


def problems(cfg: JobConfig) -> list[Problem]:
    return [*_dapo_problems(cfg), *_dpo_problems(cfg), *_turn_problems(cfg)]


DAPO_NO_KL_REASON = (
    '"during training the long-CoT reasoning model, the model distribution can diverge significantly '
    'from the initial model, thus this restriction is not necessary" (DAPO, arXiv 2503.14476, sec. 2.3)'
)


def _dapo_problems(cfg: JobConfig) -> list[Problem]:
    algo = cfg.algorithm
    if algo.name != "dapo":
        return []
    problems = []
    if algo.dapo.overlong_buffer_length > algo.max_response_length:
        problems.append(
            Problem(
                "algorithm.dapo.overlong_buffer_length",
                f"a buffer of {algo.dapo.overlong_buffer_length} tokens is longer than "
                f"algorithm.max_response_length {algo.max_response_length}; the penalty ramp must fit inside "
                "the response length, so lower it (0 turns the overlong penalty off)",
            )
        )
    if algo.kl_coef > 0:
        problems.append(
            Problem(
                "algorithm.kl_coef",
                f"{algo.kl_coef} with algorithm.name dapo, which drops the KL penalty: {DAPO_NO_KL_REASON}; "
                "unset it (dapo's default is 0), or use algorithm.name grpo for a KL-regularised run",
            )
        )
    return problems


def _dpo_problems(cfg: JobConfig) -> list[Problem]:
    """DPO samples are chosen/rejected pairs (dock groups of 2) that no hand-out may split."""
    algo, training = cfg.algorithm, cfg.training
    if algo.name != "dpo":
        return []
    problems: list[Problem] = []
    if algo.num_responses_per_prompt != 2:
        problems.append(
            Problem(
                "algorithm.num_responses_per_prompt",
                f"dpo trains on (chosen, rejected) pairs, so it must be 2, not {algo.num_responses_per_prompt}",
            )
        )
        return problems
    dp, pairs = training.data_parallel_size, algo.num_prompts_per_iteration
    if pairs % dp == 0 and (pairs // dp) % algo.num_updates_per_iteration:
        problems.append(
            Problem(
                "algorithm.num_updates_per_iteration",
                f"each of the {dp} ranks holds {pairs // dp} pairs, which cannot be split into "
                f"{algo.num_updates_per_iteration} mini-batches of whole pairs",
            )
        )
    elif pairs % dp:
        problems.append(
            Problem(
                "algorithm.num_prompts_per_iteration",
                f"{pairs} preference pairs cannot be dealt evenly over {dp} data-parallel ranks without "
                f"splitting a pair; use a multiple of {dp}",
            )
        )
    if training.micro_batch_size % 2:
        problems.append(
            Problem(
                "training.micro_batch_size",
                f"{training.micro_batch_size} samples per micro-batch would split a chosen/rejected pair; "
                "use an even size",
            )
        )
    return problems


def _turn_problems(cfg: JobConfig) -> list[Problem]:
    """What crediting an episode's turns apart (algorithm.credit, turn_discount, gae_unit) needs: turns (an
    agent), rewards per turn (an environment's step rewards or a harness's posted ones, making the reward,
    summed, weight 1), and an algorithm that reads them."""
    algo, agent = cfg.algorithm, cfg.agent
    problems: list[Problem] = []
    if algo.gae_unit == "turn":
        if not needs_critic(algo.name):
            problems.append(
                Problem(
                    "algorithm.gae_unit",
                    f"`turn` is the unit of a critic's GAE, and {algo.name} has no critic; use ppo or pf_ppo, or "
                    "algorithm.credit: turn for turn-level credit without a critic",
                )
            )
        elif agent is None:
            problems.append(
                Problem(
                    "algorithm.gae_unit",
                    "`turn` steps GAE by the model's turns, and a job without agent has one turn per response; "
                    "use `token` or add agent",
                )
            )
    if algo.turn_discount != 1 and (algo.credit != "turn" or needs_critic(algo.name)):
        problems.append(
            Problem(
                "algorithm.turn_discount",
                f"{algo.turn_discount:g} discounts the turn-level returns of a critic-free algorithm under "
                "algorithm.credit: turn, which this job does not use (a critic discounts by algorithm.ppo.gamma); "
                "remove it",
            )
        )
    if algo.credit != "turn":
        return problems
    if not credits_turns(algo.name):
        problems.append(
            Problem(
                "algorithm.credit",
                f"`turn`: {algo.name} has no turn-level estimator; use grpo, gspo, rloo, reinforce_plus_plus, "
                "reinforce_plus_plus_baseline, ppo or pf_ppo, or credit: trajectory",
            )
        )
    if agent is None or (agent.environment is None and not agent.harnessed):
        problems.append(
            Problem(
                "algorithm.credit",
                "`turn` credits each turn with the reward its step earned (the environment's, or what a harness "
                "posts to .../reward after the turn), and the job has "
                + ("no agent" if agent is None else "neither agent.environment nor a harness")
                + ": every reward would sit on the last turn; set agent.environment or use credit: trajectory",
            )
        )
        return problems
    if agent.harnessed and agent.max_segments > 1:
        problems.append(
            Problem(
                "agent.max_segments",
                f"{agent.max_segments} rows per episode with algorithm.credit `turn`: turn-level returns run over one "
                "row's turns, and a harness's episode of several segments is several rows; set agent.max_segments 1 "
                "(the last segment trains) or use credit: trajectory",
            )
        )
    terms = [term for term in cfg.reward.terms if term.name == "environment"]
    if len(terms) != 1 or (terms[0].aggregate or "sum") != "sum" or terms[0].weight != 1:
        problems.append(
            Problem(
                "reward.terms",
                "algorithm.credit `turn` splits the reward over the turns by the environment's step rewards, so "
                "the reward must count each of them once: one term {name: environment} (aggregate sum, weight 1), "
                f"not {len(terms)} environment term(s)"
                + (f" with aggregate {terms[0].aggregate or 'sum'} and weight {terms[0].weight:g}" if terms else ""),
            )
        )
    return problems
