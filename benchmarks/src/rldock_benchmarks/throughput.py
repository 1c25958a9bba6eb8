"""End-to-end throughput of the synchronous iteration, per shape, with an ablation in the same run.

For each shape the same job runs once with every optimisation on, once with each optimisation off
alone, and once with all of them off (the code as it ran before them), each in a fresh set of
workers on one local Ray. Each variant prints its medians over the iterations after warm-up: the
iteration time, T by the MindSpeed RL paper's Eq. (5) (T = G*N*(PL+SL)/ND/ETE, the
`tokens_per_s_per_device` metric), tokens/s of the whole machine (the same over one device), the
stage breakdown (`timing`: each stage's slowest rank, busy time; `compute_s`: of that, its compute
without dock calls) and each worker group's idle time
(`timing/idle/<state>`: seconds its ranks waited on the dock for upstream samples), and the ratio
of its iteration time to the all-off baseline's. The optimisations switched off one at a time:
the skipped old-logprob pass (`recompute_old_logprobs_always`), padding trimming
(`no_trim_padding`), the per-worker thread budget (`no_thread_budget`), the group advantages
computed by the reward worker in its own dock write instead of a separate advantage state
(`no_fused_advantage`) and the driver's counters and
metrics files off the critical path (`no_background_bookkeeping`) and the dock's warehouse held by
its controller host, a put or get one Ray call instead of two (`no_colocated_controllers`) and the
workers moving rows through the warehouse's shared memory, the calls carrying metadata only
(`no_shared_memory`). These four are no job config fields: a variant turns them off under its
`ablations` key, which `shape_config` sets with JobConfig.with_ablations. Finer streaming, the
rollout writing each prompt group as it finishes (`rollout.stream_groups`), is opt-in (off by
default: on short responses its extra writes cost more than they overlap), so it is the
`streaming` variant: all on plus streaming, one group per write.
`--variant` runs only the named variants (the ratios need `all_off` among them).

Shapes:
- `demo`: examples/grpo-tiny.yaml (G16 N8, ~2-token answers, the 0.5M-parameter model after its
  supervised warm-up);
- `fixed_cost`: the demo's model and workers with G2 N2 and 2-token responses, so the iteration
  is its fixed cost (dispatch, Ray round trips, bookkeeping);
- `generation_heavy`: G32 N8, 128-token responses that never stop early, a 2.4M-parameter Qwen2
  with head_dim 64 (its EOS is made (nearly) unreachable, so responses run to max_response_length);
- `early_stop`: the same model and limits with its EOS reachable: an untrained model stops after
  ~20 of the 128 allowed tokens, so most of the dock's response columns are padding.

    .venv/bin/python -m rldock_benchmarks.throughput --output runs/throughput > throughput.json
    .venv/bin/python -m rldock_benchmarks.throughput --quick --output runs/throughput-quick

`--quick` (CI smoke) runs every shape and variant scaled down (small batches, 3 iterations) to show
the script works; its timings mean nothing. Run the full benchmark on a quiet machine: the
ablation needs every variant under the same load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from rldock.config import JobConfig
from rldock.config.loading import resolve_job_config

REPO = Path(__file__).resolve().parents[3]
DEMO_CONFIG = REPO / "examples" / "grpo-tiny.yaml"
ALL_ON: dict[str, Any] = {}
# A variant's key for the optimisations that are no config field (JobConfig.ablations).
ABLATIONS = "ablations"
# Each optimisation's switch, set to what the code did before it.
SWITCHES_OFF: dict[str, dict[str, Any]] = {
    "recompute_old_logprobs_always": {"algorithm": {"recompute_old_logprobs": "always"}},
    "no_trim_padding": {"training": {"trim_padding": False}},
    "no_thread_budget": {"training": {"num_threads": 0}},
    "no_fused_advantage": {ABLATIONS: {"fuse_reward_advantage": False}},
    "no_background_bookkeeping": {ABLATIONS: {"background_bookkeeping": False}},
    "no_colocated_controllers": {ABLATIONS: {"colocate_controllers": False}},
    "no_shared_memory": {ABLATIONS: {"shared_memory": False}},
}
# Opt-in optimisations: each turned on alone, on top of every default one.
SWITCHES_ON: dict[str, dict[str, Any]] = {
    "streaming": {"rollout": {"stream_groups": 1}},  # the rollout writes each group as it finishes
}
ALL_OFF = {
    "algorithm": {"recompute_old_logprobs": "always"},
    "training": {"trim_padding": False, "num_threads": 0},
    ABLATIONS: {
        "fuse_reward_advantage": False,
        "background_bookkeeping": False,
        "colocate_controllers": False,
        "shared_memory": False,
    },
}
BASELINE = "all_off"
# The generation-heavy model: hidden 256 over 4 heads (head_dim 64, which vLLM's CPU attention takes).
HEAVY_MODEL = {
    "hidden_size": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 1280,
    "max_position_embeddings": 256,
}
NO_EOS_LOGIT_SCALE = 30.0  # the other tokens' logits reach tens: EOS at 0 keeps a negligible share


@dataclass(frozen=True)
class Shape:
    name: str
    overrides: dict[str, Any]  # merged into the demo config
    model: str  # "demo" (the demo's warmed-up model) or "heavy" / "heavy_no_eos" (built here)


def algo(g: int, n: int, pl: int, sl: int) -> dict:
    """The overrides of a shape's batch: G prompts x N responses, PL and SL tokens at most."""
    return {
        "algorithm": {
            "num_prompts_per_iteration": g,
            "num_responses_per_prompt": n,
            "max_prompt_length": pl,
            "max_response_length": sl,
        }
    }


def shape_facts(cfg: JobConfig) -> dict[str, Any]:
    """What a report says of a job's shape: G, N, PL, SL, its data-parallel ranks and KL coefficient."""
    algorithm = cfg.algorithm
    return {
        "G": algorithm.num_prompts_per_iteration,
        "N": algorithm.num_responses_per_prompt,
        "PL": algorithm.max_prompt_length,
        "SL": algorithm.max_response_length,
        "data_parallel_size": cfg.training.data_parallel_size,
        "kl_coef": algorithm.kl_coef,
    }


def shapes(quick: bool) -> list[Shape]:
    """The shapes measured; `quick` scales each down to a smoke run."""
    heavy_sl = 16 if quick else 128
    heavy_g = 4 if quick else 32
    demo_warmup = {"warmup": {"steps": 2}} if quick else {}
    return [
        Shape("demo", {**algo(4, 4, 8, 6), **demo_warmup} if quick else {}, "demo"),
        Shape("fixed_cost", {**algo(2, 2, 8, 2), **demo_warmup}, "demo"),
        Shape("generation_heavy", {**algo(heavy_g, 8, 8, heavy_sl), "warmup": {"steps": 0}}, "heavy_no_eos"),
        Shape("early_stop", {**algo(heavy_g, 8, 8, heavy_sl), "warmup": {"steps": 0}}, "heavy"),
    ]


def merge(base: dict, extra: dict) -> dict:
    """`base` with `extra`'s leaves set (nested dicts merged, other values replaced)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge(out.get(key, {}), value) if isinstance(value, dict) else value
    return out


def build_heavy_models(root: Path, seed: int) -> dict[str, Path]:
    """The generation-heavy Qwen2 (built once) and a copy that (almost) never samples EOS, so
    responses run to max_response_length: its LM head is untied, EOS's row zeroed (logit 0) and the
    other rows scaled up, so some other token's logit is far above 0 at every position. (vLLM
    refuses a stop id outside the vocabulary, so EOS itself must stay a real token.)"""
    import torch
    from transformers import Qwen2ForCausalLM

    from rldock.runtime.data import ALPHABET
    from rldock.runtime.models.loading import load_tokenizer
    from rldock.runtime.models.tiny import build_tiny_model

    heavy, no_eos = root / "heavy-qwen2", root / "heavy-qwen2-no-eos"
    if not (heavy / "config.json").is_file():
        # the addition prompts' characters: digits, + and =
        build_tiny_model(heavy, texts=[ALPHABET], seed=seed, **HEAVY_MODEL)
    if not (no_eos / "config.json").is_file():
        tokenizer = load_tokenizer(heavy)
        model = Qwen2ForCausalLM.from_pretrained(heavy)
        head = model.get_input_embeddings().weight.detach().clone() * NO_EOS_LOGIT_SCALE  # (V, H)
        head[tokenizer.eos_token_id] = 0.0
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
        model.save_pretrained(no_eos)
        tokenizer.save_pretrained(no_eos)
    return {"heavy": heavy, "heavy_no_eos": no_eos}


def shape_config(shape: Shape, variant: dict, *, iterations: int, models: dict[str, Path]) -> JobConfig:
    data = yaml.safe_load(DEMO_CONFIG.read_text())
    data = merge(data, shape.overrides)
    variant = dict(variant)
    ablations = variant.pop(ABLATIONS, {})
    data = merge(data, variant)
    data["iterations"] = iterations
    data["checkpoint"] = {"interval": iterations, "keep_last": 1}
    if shape.model != "demo":
        data["model"] = {"path": str(models[shape.model]), "dtype": "float32"}
    return resolve_job_config(data, source=f"throughput shape {shape.name}").with_ablations(**ablations)


def run_variant(cfg: JobConfig, output: Path, warm_start: Path | None) -> list[dict]:
    """One job in fresh workers; the demo's warm-up is copied in rather than redone."""
    from rldock.runtime.driver.inputs import WARMUP_DIR
    from rldock.runtime.driver.trainer import Trainer

    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    if warm_start is not None:
        shutil.copytree(warm_start, output / WARMUP_DIR)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON report
        return Trainer(cfg, output, show_progress=False).run()


def summarise(records: list[dict], cfg: JobConfig, warmup_iterations: int) -> dict:
    """Medians over the iterations after warm-up."""
    measured = records[warmup_iterations:] or records[-1:]
    algo = cfg.algorithm

    def median(key: str) -> float:
        return statistics.median(r[key] for r in measured)

    timing_keys = sorted({k for r in measured for k in r["timing"]})
    timing = {k: statistics.median(r["timing"].get(k, 0.0) for r in measured) for k in timing_keys}
    # End to end per iteration (the driver's bookkeeping between iterations included, inline or
    # not); a run too short to have one falls back to the iteration's own time.
    seconds = timing["cycle"] if all("cycle" in r["timing"] for r in measured) else timing["iteration"]
    tokens = (
        algo.num_prompts_per_iteration
        * algo.num_responses_per_prompt
        * (median("prompt_length_mean") + median("response_length_mean"))
    )
    return {
        "iterations_measured": len(measured),
        "iteration_s": seconds,
        "T_tokens_per_s_per_device": median("tokens_per_s_per_device"),
        "tokens_per_s_machine": tokens / seconds,
        "response_length_mean": median("response_length_mean"),
        "prompt_length_mean": median("prompt_length_mean"),
        "reward_mean": median("reward_mean"),
        "stages_s": {
            k: v
            for k, v in timing.items()
            if not k.startswith(("idle/", "compute/")) and k not in ("iteration", "cycle")
        },
        "compute_s": {k.removeprefix("compute/"): v for k, v in timing.items() if k.startswith("compute/")},
        "idle_s": {k.removeprefix("idle/"): v for k, v in timing.items() if k.startswith("idle/")},
    }


def run_shape(shape: Shape, *, args, models: dict[str, Path], warm_starts: dict[str, Path]) -> dict:
    """Every variant of `shape`; `warm_starts` (model and warm-up settings -> a finished warm-up)
    is shared by the shapes, so each warm-up runs once."""
    variants = {
        name: v
        for name, v in {"all_on": ALL_ON, **SWITCHES_OFF, **SWITCHES_ON, BASELINE: ALL_OFF}.items()
        if not args.variant or name in args.variant
    }
    results: dict[str, Any] = {}
    for name, variant in variants.items():
        cfg = shape_config(shape, variant, iterations=args.iterations, models=models)
        warm_key = json.dumps([cfg.model.model_dump(), cfg.warmup.model_dump()], sort_keys=True)
        output = args.output / shape.name / name
        started = time.perf_counter()
        records = run_variant(cfg, output, warm_starts.get(warm_key) if cfg.warmup.steps else None)
        if cfg.warmup.steps and warm_key not in warm_starts:
            kept = args.output / "warmups" / str(len(warm_starts))  # apart: each variant's dir is replaced
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(output / "warmup", kept)
            warm_starts[warm_key] = kept
        results[name] = {**summarise(records, cfg, args.warmup_iterations), "wall_s": time.perf_counter() - started}
        logging.info("%s/%s: %.3f s per iteration", shape.name, name, results[name]["iteration_s"])
    if BASELINE in results:
        base = results[BASELINE]["iteration_s"]
        for result in results.values():
            result["iteration_time_vs_all_off"] = result["iteration_s"] / base
    return {"shape": {**shape_facts(cfg), "model": shape.model}, "variants": results}


def run_shape_benchmark(
    description: str, *, default_output: str, shape_names: tuple[str, ...], unit: str, run_shape: Callable[..., dict]
) -> None:
    """The command line and main loop of the benchmarks that compare variants of a job on some of
    the shapes above (async_pipeline, partial_rollout): `run_shape(shape, args=, models=)` measures
    one shape's variants; the report (one JSON document on stdout) holds them per shape."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", type=Path, default=Path(default_output))
    parser.add_argument("--quick", action="store_true", help="small shapes, 4 iterations: a smoke run")
    parser.add_argument("--iterations", type=int, default=None, help=f"per {unit} (default 16; quick 4)")
    parser.add_argument("--warmup-iterations", type=int, default=None, help="not measured (default 4; quick 1)")
    parser.add_argument("--shape", action="append", choices=shape_names, help="only these shapes (default: all)")
    args = parser.parse_args()
    args.iterations = args.iterations or (4 if args.quick else 16)
    args.warmup_iterations = args.warmup_iterations if args.warmup_iterations is not None else (1 if args.quick else 4)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    import ray

    from rldock_benchmarks.harness import machine

    args.output.mkdir(parents=True, exist_ok=True)
    selected = [s for s in shapes(args.quick) if s.name in (args.shape or shape_names)]
    models = build_heavy_models(args.output / "models", seed=0) if any(s.model != "demo" for s in selected) else {}
    report: dict[str, Any] = {
        "quick": args.quick,
        "iterations": args.iterations,
        "warmup_iterations": args.warmup_iterations,
        "machine": machine(),
        "shapes": {},
    }
    # Ray forwards its workers' and raylet's lines to the driver's stdout, also after a job ends:
    # stdout carries only the JSON report.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            for shape in selected:
                report["shapes"][shape.name] = run_shape(shape, args=args, models=models)
        finally:
            if ray.is_initialized():
                ray.shutdown()
    print(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/throughput"))
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 iterations: a smoke run")
    parser.add_argument("--iterations", type=int, default=None, help="per variant (default 16; quick 3)")
    parser.add_argument("--warmup-iterations", type=int, default=None, help="not measured (default 4; quick 1)")
    parser.add_argument("--shape", action="append", help="only these shapes (default: all)")
    parser.add_argument(
        "--variant", action="append", help="only these variants (default: all; the ratios to all_off need all_off)"
    )
    args = parser.parse_args()
    args.iterations = args.iterations or (3 if args.quick else 16)
    args.warmup_iterations = args.warmup_iterations if args.warmup_iterations is not None else (1 if args.quick else 4)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    import ray

    from rldock_benchmarks.harness import machine

    args.output.mkdir(parents=True, exist_ok=True)
    selected = [s for s in shapes(args.quick) if not args.shape or s.name in args.shape]
    models = build_heavy_models(args.output / "models", seed=0) if any(s.model != "demo" for s in selected) else {}
    report: dict[str, Any] = {
        "quick": args.quick,
        "iterations": args.iterations,
        "warmup_iterations": args.warmup_iterations,
        "machine": machine(),
        "shapes": {},
    }
    warm_starts: dict[str, Path] = {}
    # Ray forwards its workers' and raylet's lines to the driver's stdout, also after a job ends:
    # stdout carries only the JSON report.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            for shape in selected:
                report["shapes"][shape.name] = run_shape(shape, args=args, models=models, warm_starts=warm_starts)
        finally:
            if ray.is_initialized():
                ray.shutdown()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
