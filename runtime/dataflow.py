"""The GRPO sample flow as data: which worker state reads which dock columns, and what it writes.

Every stage reads its inputs from the transfer dock and writes its outputs back to it; nothing
else carries samples between stages. The controller of each state only hands out a sample once all
of the columns listed here are ready for it, which is what orders the stages.
"""

from __future__ import annotations

PROMPT = ("prompt_ids", "prompt_mask")
ANSWER = ("answer_ids", "answer_mask")
RESPONSE = ("response_ids", "response_mask")

# state -> columns it consumes
CONSUMES: dict[str, tuple[str, ...]] = {
    "rollout": PROMPT,
    "actor_inference": PROMPT + RESPONSE,
    "reference": PROMPT + RESPONSE,
    "reward": RESPONSE + ANSWER,
    "advantage": ("reward",),
    "update": PROMPT + RESPONSE + ("old_logprobs", "ref_logprobs", "advantage"),
}

# 0/1 mask columns whose per-sample sums are a sample's tokens: the dock uses them to deal the
# update's samples over DP ranks with about equal token counts.
TOKEN_COLUMNS: tuple[str, ...] = ("prompt_mask", "response_mask")

# state -> columns it produces (documentation and a test that the flow is closed)
PRODUCES: dict[str, tuple[str, ...]] = {
    "driver": PROMPT + ANSWER,
    "rollout": RESPONSE,
    "actor_inference": ("old_logprobs",),
    "reference": ("ref_logprobs",),
    "reward": ("reward",),
    "advantage": ("advantage",),
    "update": (),
}
