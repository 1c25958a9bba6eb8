"""A hand count of each iteration's model FLOPs against the `flops/<stage>` a run recorded, printed as JSON.

The count here shares no code with the product's (runtime/driver/utilisation.py and the passes' tallies):
the weights come from the model folder's safetensors headers (every 2-D tensor of the decoder
layers, the embedding's V x H for the head), the tokens from metrics.jsonl's means
(prompt_length_mean P, response_length_mean R) and the config's G prompts x N responses, and the
layout from what the runtime does for a GRPO job with packed passes: the rollout prefills each of
the G prompts once and decodes R - 1 tokens per response; the update and the reference pass each
prompt once and every response token, 3x the forward for the update (+ the LM head's recomputed
logits), 1x for the reference. With several ranks the update's and the reference's counts are also given with
each prompt computed once per rank (`hand_split`): the dock deals their samples to the ranks by
tokens or in batches, not by group, so a group's responses can sit on several ranks, and each
rank's packed pass computes the prompt.

    python -m rldock_benchmarks.flop_count --output /tmp/mfu-demo

prints one object per iteration and stage: `reported`, `hand` and their `ratio`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors import safe_open


def weight_counts(model_dir: Path) -> dict[str, int]:
    """`layers` (weights of the decoder layers' matmuls), `query_width` (heads x head_dim of one
    layer's q projection), `num_layers` and `embedding` (V x H) from the folder's safetensors."""
    shapes: dict[str, list[int]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as weights:
            shapes.update({name: list(weights.get_slice(name).get_shape()) for name in weights.keys()})
    layers = {name: shape for name, shape in shapes.items() if ".layers." in name and len(shape) == 2}
    (query,) = [shape for name, shape in layers.items() if name.endswith("layers.0.self_attn.q_proj.weight")]
    (embedding,) = [shape for name, shape in shapes.items() if name.endswith("embed_tokens.weight")]
    return {
        "layers": sum(rows * columns for rows, columns in layers.values()),
        "query_width": query[0],
        "num_layers": len({name.split(".layers.")[1].split(".")[0] for name in layers}),
        "embedding": embedding[0] * embedding[1],
    }


def hand_count(
    weights: dict[str, int], record: dict, *, num_prompts: int, num_responses: int, prompt_copies: int = 1
) -> dict[str, float]:
    """FLOPs per stage of one iteration (module docstring) from its record's mean lengths; the
    update and the reference computing each prompt `prompt_copies` times (a group's responses dealt
    to that many ranks, each rank's packed pass computing the prompt)."""
    prompt, response = record["prompt_length_mean"], record["response_length_mean"]
    g, n = num_prompts, num_responses
    per_token = 2 * weights["layers"]  # a multiply and an add per weight
    per_pair = 4 * weights["num_layers"] * weights["query_width"]  # q.k, then the weighted v, per layer
    per_head = 2 * weights["embedding"]  # one position through the LM head

    def forward(tokens: float, pairs: float, heads: float) -> float:
        return per_token * tokens + per_pair * pairs + per_head * heads

    # rollout: G prompts prefilled, then each response's R - 1 decode steps at positions P .. P + R - 2
    steps = response - 1
    rollout = forward(
        g * prompt + g * n * steps,
        g * prompt * (prompt + 1) / 2 + g * n * (steps * prompt + steps * (steps + 1) / 2),
        g * n + g * n * steps,
    )

    # a packed pass over a group: its prompt once, then each response attending the prompt and itself
    def packed(copies: int) -> float:
        tokens = copies * g * prompt + g * n * response
        pairs = copies * g * prompt * (prompt + 1) / 2 + g * n * (response * prompt + response * (response + 1) / 2)
        return forward(tokens, pairs, 0)

    head = forward(0, 0, g * n * response)  # the scored tokens
    return {
        "rollout": rollout,
        "update": 3 * packed(prompt_copies) + 4 * head,
        "reference": packed(prompt_copies) + head,
    }


def compare(run: Path, model_dir: Path | None = None) -> list[dict]:
    """Per iteration and stage of `run`'s metrics.jsonl: the recorded FLOPs, the hand count, their ratio."""
    config = json.loads((run / "config.json").read_text())
    model = model_dir or Path(config["model"]["path"]).expanduser()
    weights = weight_counts(model)
    algorithm = config["algorithm"]
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "prompt_length_mean" not in record:  # iteration 0: an evaluation, no training
            continue
        shape = {
            "num_prompts": algorithm["num_prompts_per_iteration"],
            "num_responses": algorithm["num_responses_per_prompt"],
        }
        hand = hand_count(weights, record, **shape)
        # The dock deals the samples to the ranks by tokens or batches, not by group: a group split
        # over D ranks has its prompt computed by each. The upper end: every group on every rank.
        ranks = min(config["training"]["data_parallel_size"], shape["num_responses"])
        split = hand_count(weights, record, **shape, prompt_copies=ranks)
        for stage, flops in hand.items():
            if f"flops/{stage}" not in record:
                continue
            reported = record[f"flops/{stage}"]
            row = {"iteration": record["iteration"], "stage": stage, "reported": reported, "hand": flops}
            row["ratio"] = reported / flops
            if split[stage] != flops:
                row.update(hand_split=split[stage], ratio_split=reported / split[stage])
            if f"mfu/{stage}" in record:
                row["mfu"] = record[f"mfu/{stage}"]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, type=Path, help="a run's --output folder")
    parser.add_argument("--model", type=Path, help="the model folder (default: the run's model.path)")
    args = parser.parse_args(argv)
    for row in compare(args.output, args.model):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
