"""The dock's columns as data: the named column groups the worker states read and write (each
state's own columns are in its spec, runtime/src/rldock/runtime/flow/states.py; each algorithm's recipe
in runtime/src/rldock/runtime/flow/catalogue.py lists its states).

Every stage reads its inputs from the transfer dock and writes its outputs back to it; nothing
else carries samples between stages. The controller of each state only hands out a sample once all
of the columns its spec reads are ready for it, which is what orders the stages.
"""

from __future__ import annotations

PROMPT = ("prompt_ids", "prompt_mask")
# (B,) int64: the train-file row of each sample's prompt (what a harness's task names it by).
PROMPT_INDEX = ("prompt_index",)
# (B, W) uint8: that row itself (its prompt, ground truth, data source, extra info and columns), pickled and
# zero-padded to the job's longest (data/row_column.py): the driver, which loads the rows, puts it with the
# prompt, and the reward and an agent's rollout read it here, so no worker reads the train files.
PROMPT_ROW = ("prompt_row",)
# (B,) int64: each sample's prompt group by its draw number (0, 1, ... in the order the driver's feed drew
# prompts, across epochs): the driver puts it with the prompt, a rollout that writes a group into other
# rows (carried episodes) writes it with the group's prompt, and the driver reads it back through the
# sample_facts state, so the prompt ledger (driver/prompt_ledger.py) counts the groups each update trained.
PROMPT_DRAW = ("prompt_draw",)
RESPONSE = ("response_ids", "response_mask")
# (B,) int64: the policy version (weight updates behind the engine's weights) that generated each
# response, written by the rollout; the update measures each sample's staleness from it.
POLICY_VERSION = ("policy_version",)
# (B,) int64: each response's tokens, every token after the prompt (a multi-turn trajectory's tool and
# environment tokens included): written with the response by the rollout (the driver for DPO's pairs)
# and read by the driver through the sample_facts state (response_length_mean, throughput, utilisation).
RESPONSE_LENGTH = ("response_length",)
# Partial rollout only (rollout.partial_rollout, rollout/partial.py): `sampled_logprobs`
# (B, SL) float32, each response token's logprob under the weights that sampled it, and
# `prefix_length` (B,) int64, how many leading response tokens `policy_version` sampled (the rest the
# next version, after a weight update cut the generation); the old-logprob pass reads both.
PARTIAL_ROLLOUT = ("sampled_logprobs", "prefix_length")
# Partial rollout of agent episodes (rldock.runtime.rollout.agent_episodes): `sampled_logprobs` as above and
# `token_policy_version` (B, SL) int64, the policy version that sampled each response token (-1 on tool,
# environment and padding tokens): an episode's turns, and one turn cut at a weight update, span versions.
AGENT_PARTIAL_ROLLOUT = ("sampled_logprobs", "token_policy_version")
# (B,) float32: a learned reward model's scalar for each prompt + response, written by the
# `reward_model` state (only in a job with a `model` reward term: job_recipe adds it) and read by
# the reward state as that term's scores.
RM_SCORE = ("rm_score",)

# Routing replay only (algorithm.routing_replay `reference`, models/routing_replay.py): `routed_experts`
# (B, PL + SL, MoE layers, top_k) int16, the experts the old-logprob pass's routers chose for each prompt
# and response token, -1 where it computed no token (padding); written by `actor_inference`, read by
# the update, whose forward routes by it.
ROUTED_EXPERTS = ("routed_experts",)

# Multi-turn rollouts only (JobConfig.agent, docs/agentic.md): `response_attention_mask` (B, SL), 1 on
# every response token the policy attends to, the tools' and the environment's included, where
# `response_mask` marks only the model's own (trained and scored); every state that reads the response
# reads it. `num_turns`, `num_tool_calls`, `num_tool_errors` (B,) int64, what the reward sees of the
# trajectory besides its text.
# `environment_rewards` (B, agent.max_turns) float32, the environment's reward for each step (0 where it
# gave none, and past the episode's `num_environment_steps` (B,) int64), what an `environment` reward
# term aggregates.
RESPONSE_ATTENTION = ("response_attention_mask",)
TRAJECTORY_COUNTS = ("num_turns", "num_tool_calls", "num_tool_errors", "environment_rewards", "num_environment_steps")
# Multi-turn rollouts only, what an advantage estimator reads of the turns (agent/trajectory.py: turn_columns):
# `turn_index` (B, SL) int64, per response token the model turn it was sampled in (0, 1, ...), -1 on tool,
# environment and padding tokens; `turn_rewards` (B, agent.max_turns) float32, the environment's reward for
# the step each turn took (0 for a turn that called tools, and past the episode's turns).
TURNS = ("turn_index", "turn_rewards")

# A harness's episodes only (agent.max_segments > 1, docs/agentic.md#segments): an episode is S consecutive
# rows, one per segment, its last segment (the one the reward judges) first, then its earlier ones, then
# empty rows. `episode` (B,) int64, the iteration's number of each row's episode, written by the driver
# with the prompts: the reward scores each episode's first row and writes its reward on every row, the
# advantage's baselines, DAPO's filter and the driver's reward_mean count each episode once
# (algorithms/episode_rows.py). `episode_share` (B,) float32, each row's share of its episode's model tokens,
# written by the advantage stage (which sees whole episodes) and read by the update's loss aggregation.
EPISODE = ("episode",)
EPISODE_SHARE = ("episode_share",)

# 0/1 mask columns whose per-sample sums are a sample's tokens: the dock uses them to deal the
# update's samples over DP ranks with about equal token counts.
TOKEN_COLUMNS: tuple[str, ...] = ("prompt_mask", "response_mask")
