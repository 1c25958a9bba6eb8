"""What the reward sees of a multi-turn trajectory: the model's final turn is `solution_str`, the answer
the rule rewards check (a number the tool printed is not the model's answer); the whole trajectory's
text, counts and the environment's per-step rewards are in `extra_info["trajectory"]` for a reward function
of your own and the `environment` term (docs/agentic.md)."""

from __future__ import annotations

from collections.abc import Sequence


def final_turn_span(model_mask: Sequence[int]) -> slice:
    """The positions of the last run of model tokens (the final turn) in a trajectory's mask."""
    end = len(model_mask)
    while end and not model_mask[end - 1]:
        end -= 1
    start = end
    while start and model_mask[start - 1]:
        start -= 1
    return slice(start, end)


def final_texts(tokenizer, batch) -> list[str]:
    """Each trajectory's final turn as text: up to EOS, special tokens dropped, as a single-turn
    response is decoded."""
    eos = tokenizer.eos_token_id
    texts = []
    for ids, model_mask in zip(batch["response_ids"].tolist(), batch["response_mask"].tolist()):
        final = ids[final_turn_span(model_mask)]
        if eos in final:
            final = final[: final.index(eos)]
        texts.append(tokenizer.decode(final, skip_special_tokens=True))
    return texts


def reward_views(tokenizer, batch) -> tuple[list[str], list[dict]]:
    """Per sample of a batch with the agent's columns: `final_texts`, and its `trajectory` entry: the
    whole trajectory's text (special tokens kept, so the turns show), its turn, call and error counts, and
    the environment's reward for each step."""
    trajectories = []
    rows = zip(
        batch["response_ids"].tolist(),
        batch["response_attention_mask"].tolist(),
        batch["num_turns"].tolist(),
        batch["num_tool_calls"].tolist(),
        batch["num_tool_errors"].tolist(),
        batch["environment_rewards"].tolist(),
        batch["num_environment_steps"].tolist(),
    )
    for ids, attention, turns, calls, errors, rewards, steps in rows:
        whole = [token for token, attended in zip(ids, attention) if attended]
        trajectories.append(
            {
                "text": tokenizer.decode(whole, skip_special_tokens=False),
                "num_turns": turns,
                "num_tool_calls": calls,
                "num_tool_errors": errors,
                "environment_rewards": rewards[:steps],
            }
        )
    return final_texts(tokenizer, batch), trajectories


def is_trajectory(batch) -> bool:
    """Whether a batch carries the agent's columns (a job with an `agent` section)."""
    return "response_attention_mask" in batch.keys()
