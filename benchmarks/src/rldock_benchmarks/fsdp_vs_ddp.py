"""FSDP vs DDP on the same model, side by side in one run: per-rank training-state bytes, the loss of
every step, seconds per step, and the memory planner's figure for the same run. Prints one JSON document.

    .venv/bin/python -m rldock_benchmarks.fsdp_vs_ddp                          # a ~110M Llama, 2 ranks
    .venv/bin/python -m rldock_benchmarks.fsdp_vs_ddp --model-dir ~/.cache/rldock/models/SmolLM2-135M-Instruct \
        --gradient-checkpointing

Each strategy runs `--world` gloo ranks (torch.multiprocessing, CPU), one after the other, from the
same initial weights on the same batches: every step all ranks take their half of one fixed global
batch of random tokens (the same batch every step, so the loss must fall: the model learns it) and
step AdamW on the token-mean causal-LM loss. The ranks wrap the model with the runtime's own
`wrap_ddp` / `apply_fsdp` and, with --gradient-checkpointing, `enable_activation_checkpointing`.

Training-state bytes are this rank's parameters, gradients and AdamW state (local shards for
FSDP), measured after the first optimizer step with the gradients still held: what the planner's
`training_state_bytes` predicts. Losses agree between the strategies up to float reordering of the
reductions: the tolerance is 1e-4 relative per step (measured differences are printed). Step times
are medians over the steps after the first; they are under whatever load the machine has, so only
the ratio is meaningful.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOSS_RTOL = 1e-4
# A ~110M-parameter Llama (tied embeddings): vocab, hidden, layers, heads, KV heads, intermediate.
DEFAULT_SHAPE = dict(
    vocab_size=32000,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    intermediate_size=2048,
    tie_word_embeddings=True,
)


def build_model(model_dir: str | None, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rldock.runtime.models.loading import load_causal_lm

    if model_dir:
        return load_causal_lm(model_dir, dtype="float32", device="cpu").eval()
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**DEFAULT_SHAPE, max_position_embeddings=512)).eval()


def model_config(model_dir: str | None) -> dict:
    if model_dir:
        return json.loads((Path(model_dir) / "config.json").read_text())
    return {**DEFAULT_SHAPE, "model_type": "llama"}


def _state_bytes(model, optimizer) -> dict[str, int]:
    """Distinct storages only: FSDP's sharded gradients are views into one reduce-scatter buffer."""
    from rldock.runtime.resharding.ledger import resident_bytes
    from rldock.runtime.resharding.swap import training_state

    seen: set[int] = set()
    return {
        category: resident_bytes(tensors, device_type="cpu", seen=seen)
        for category, tensors in training_state(model, optimizer).items()
    }


def _rank(rank: int, args: argparse.Namespace, strategy: str, port: int, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.fsdp_sharding import apply_fsdp, clip_grad_norm
    from rldock.runtime.engines.process_group import wrap_ddp
    from rldock.runtime.models.layers import enable_activation_checkpointing
    from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    device = detect_device("cpu")
    model = build_model(args.model_dir, args.seed)
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if strategy == "fsdp":
        mesh = ParallelMesh(MeshShape(dp=args.world), "cpu")
        trained = apply_fsdp(model, device, mesh, mixed_precision=args.mixed_precision)
    else:
        trained = wrap_ddp(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model_config(args.model_dir)["vocab_size"]
    batch = torch.randint(0, vocab, (args.world * args.batch_per_rank, args.seq_len), generator=generator)
    mine = batch[rank * args.batch_per_rank : (rank + 1) * args.batch_per_rank]  # (b, T)
    losses, seconds, state = [], [], None
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = trained(input_ids=mine, labels=mine).loss  # token mean; equal tokens per rank
        loss.backward()
        if strategy == "fsdp":
            clip_grad_norm(model, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        seconds.append(time.perf_counter() - start)
        if state is None:  # AdamW state exists after the first step; gradients are still held
            state = _state_bytes(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / args.world)
    (Path(out_dir) / f"{strategy}-{rank}.json").write_text(
        json.dumps({"state_bytes": state, "losses": losses, "step_s": seconds})
    )
    dist.barrier()  # every rank has written its result
    # End the rank without tearing torch down: when this frame's locals go, DDP's reducer can drop
    # the last reference to the gloo process group, whose destructor joins gloo's worker threads
    # while holding the GIL; a worker still releasing a tensor needs the GIL, and both wait forever
    # (seen once in CI, in the DDP rank of test_planner_matches_fsdp_ranks...). The process ends
    # here anyway, and its result is on disk.
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_strategy(args: argparse.Namespace, strategy: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(args, strategy, _free_port(), out_dir), nprocs=args.world)
        return [json.loads((Path(out_dir) / f"{strategy}-{rank}.json").read_text()) for rank in range(args.world)]


def planned_state_bytes(args: argparse.Namespace, strategy: str) -> int:
    """The planner's params + grads + optimizer state per rank for this run."""
    from rldock.config import parse_job_config
    from rldock.runtime.planning.memory import training_state_bytes
    from rldock.runtime.planning.shapes import shape_from_hf_config

    cfg = parse_job_config(
        {
            "iterations": 1,
            "model": {"path": args.model_dir or "unused"},
            # Planned, never trained: the planner reads no prompts or rewards, but a model of one's own must name them.
            "data": {"generator": {"name": "addition"}},
            "reward": {"terms": [{"name": "digit_match"}]},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": args.world,
                "num_responses_per_prompt": 2,
                "max_prompt_length": 1,
                "max_response_length": args.seq_len,
                "learning_rate": args.learning_rate,
            },
            "training": {"strategy": strategy, "data_parallel_size": args.world},
            "resources": {"device": "cpu", "devices_per_node": args.world},
            "checkpoint": {"interval": 1},
        }
    )
    return sum(training_state_bytes(cfg, shape_from_hf_config(model_config(args.model_dir), name="benchmark")))


def median_step_s(ranks: list[dict]) -> float:
    """A step takes as long as its slowest rank; the first step (warm-up) is left out when there are more."""
    steps = [max(times) for times in zip(*(r["step_s"] for r in ranks), strict=True)]
    return statistics.median(steps[1:] or steps)


def summarize(args: argparse.Namespace, results: dict[str, list[dict]]) -> dict:
    report: dict = {
        "world": args.world,
        "steps": args.steps,
        "model_dir": args.model_dir,
        "gradient_checkpointing": args.gradient_checkpointing,
        "loss_rtol": LOSS_RTOL,
    }
    for strategy, ranks in results.items():
        totals = [sum(r["state_bytes"].values()) for r in ranks]
        report[strategy] = {
            "state_bytes_per_rank": totals,
            "state_bytes_by_category_rank0": ranks[0]["state_bytes"],
            "planned_state_bytes_per_rank": planned_state_bytes(args, strategy),
            "losses": ranks[0]["losses"],
            "median_step_s": median_step_s(ranks),
        }
    if {"ddp", "fsdp"} <= results.keys():
        ddp, fsdp = report["ddp"], report["fsdp"]
        report["state_ratio_fsdp_over_ddp"] = max(fsdp["state_bytes_per_rank"]) / max(ddp["state_bytes_per_rank"])
        report["max_loss_rel_diff"] = max(
            abs(a - b) / abs(a) for a, b in zip(ddp["losses"], fsdp["losses"], strict=True)
        )
        report["losses_equal"] = report["max_loss_rel_diff"] <= LOSS_RTOL
        report["step_time_ratio_fsdp_over_ddp"] = fsdp["median_step_s"] / ddp["median_step_s"]
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="a HF model folder (default: a random ~110M Llama)")
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch-per-rank", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--mixed-precision",
        default="none",
        choices=["none", "bf16", "fp16"],
        help="FSDP only (DDP computes in float32)",
    )
    parser.add_argument(
        "--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per rank"
    )
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = {strategy: run_strategy(args, strategy) for strategy in args.strategies.split(",")}
    print(json.dumps(summarize(args, results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
