"""The sample flows as data: which worker state reads which dock columns, and what it writes
(GRPO's, PPO's with its critic states, ...; each algorithm's recipe in
runtime/src/rldock/runtime/algorithms/recipes.py picks one).

Every stage reads its inputs from the transfer dock and writes its outputs back to it; nothing
else carries samples between stages. The controller of each state only hands out a sample once all
of the columns listed here are ready for it, which is what orders the stages.
"""

from __future__ import annotations

PROMPT = ("prompt_ids", "prompt_mask")
# (B,) int64: the train-file row of each sample's prompt; the reward worker looks the ground truth,
# data source and extra info up by it in its own copy of the rows.
PROMPT_INDEX = ("prompt_index",)
RESPONSE = ("response_ids", "response_mask")
# (B,) int64: the policy version (weight updates behind the engine's weights) that generated each
# response, written by the rollout; the update measures each sample's staleness from it.
POLICY_VERSION = ("policy_version",)
# Partial rollout only (rollout.partial_rollout, workers/partial_rollout.py): `sampled_logprobs`
# (B, SL) float32, each response token's logprob under the weights that sampled it, and
# `prefix_length` (B,) int64, how many leading response tokens `policy_version` sampled (the rest the
# next version, after a weight update cut the generation); the old-logprob pass reads both.
PARTIAL_ROLLOUT = ("sampled_logprobs", "prefix_length")
# (B,) float32: a learned reward model's scalar for each prompt + response, written by the
# `reward_model` state (only in a job with a `model` reward term: job_recipe adds it) and read by
# the reward state as that term's scores.
RM_SCORE = ("rm_score",)
REWARD_MODEL_STATE = "reward_model"

# state -> columns it consumes
CONSUMES: dict[str, tuple[str, ...]] = {
    "rollout": PROMPT,
    "actor_inference": PROMPT + RESPONSE,
    "reference": PROMPT + RESPONSE,
    "reward": RESPONSE + PROMPT_INDEX,
    "advantage": ("reward",),
    "update": PROMPT + RESPONSE + ("old_logprobs", "ref_logprobs", "advantage") + POLICY_VERSION,
}

# PPO (and PF-PPO): GRPO's states plus a critic's. The critic scores every response token before
# the advantage stage (GAE needs the values), and trains on the returns that stage writes.
PPO_CONSUMES: dict[str, tuple[str, ...]] = {
    **CONSUMES,
    "critic_inference": PROMPT + RESPONSE,
    "advantage": ("reward", "values", "response_mask"),
    "critic_update": PROMPT + RESPONSE + ("values", "returns"),
}

# PF-PPO: PPO's, with each response's filtration weight (B,) float32 >= 0, which the update's loss
# aggregation applies to its tokens (0: the response adds nothing to the loss or its count).
PF_PPO_CONSUMES: dict[str, tuple[str, ...]] = {
    **PPO_CONSUMES,
    "update": PPO_CONSUMES["update"] + ("loss_weight",),
}

# REINFORCE++ (and its baseline variant): GRPO's states; the advantage state normalises over the
# iteration's whole batch, each response weighted by its tokens, so it reads the response mask.
BATCH_NORMALISED_CONSUMES: dict[str, tuple[str, ...]] = {
    **CONSUMES,
    "advantage": ("reward", "response_mask"),
}

# DAPO: GRPO's states; with dynamic sampling the driver reads each round's per-sample `score` (the
# rule reward before overlong shaping, (B,) floats: the only column that reaches the driver)
# through `sample_filter`, and the dock empties and refills the groups it drops; the samples of the
# kept groups stay in the warehouses for the remaining states.
DAPO_CONSUMES: dict[str, tuple[str, ...]] = {
    **CONSUMES,
    # the unshaped score too: a group whose scores are all equal gets advantage exactly 0
    "advantage": ("reward", "score"),
    "sample_filter": ("score",),
}

# DPO: the driver puts chosen/rejected pairs as finished responses (no rollout, reward or
# advantage); the reference scores them and the actor trains on the preference loss.
DPO_CONSUMES: dict[str, tuple[str, ...]] = {
    "reference": PROMPT + RESPONSE,
    "preference_update": PROMPT + RESPONSE + ("ref_logprobs",),
}

# 0/1 mask columns whose per-sample sums are a sample's tokens: the dock uses them to deal the
# update's samples over DP ranks with about equal token counts.
TOKEN_COLUMNS: tuple[str, ...] = ("prompt_mask", "response_mask")

# state -> columns it produces (documentation and a test that the flow is closed)
PRODUCES: dict[str, tuple[str, ...]] = {
    "driver": PROMPT + PROMPT_INDEX,
    "rollout": RESPONSE + POLICY_VERSION,
    "actor_inference": ("old_logprobs",),
    "reference": ("ref_logprobs",),
    "reward": ("reward",),
    "advantage": ("advantage",),
    "update": (),
}

PPO_PRODUCES: dict[str, tuple[str, ...]] = {
    **PRODUCES,
    "critic_inference": ("values",),
    "advantage": ("advantage", "returns"),
    "critic_update": (),
}

PF_PPO_PRODUCES: dict[str, tuple[str, ...]] = {
    **PPO_PRODUCES,
    "advantage": ("advantage", "returns", "loss_weight"),
}

DAPO_PRODUCES: dict[str, tuple[str, ...]] = {
    **PRODUCES,
    "reward": ("reward", "score"),  # shaped (what the advantages use) and unshaped (what the filter uses)
    "sample_filter": (),
}

DPO_PRODUCES: dict[str, tuple[str, ...]] = {
    "driver": PROMPT + RESPONSE,
    "reference": ("ref_logprobs",),
    "preference_update": (),
}
