"""Allgather-swap vs naive resharding: device-resident bytes during generation, swap speed, and the
share of the iteration that resharding takes. Prints one JSON document.

    .venv/bin/python -m rldock_benchmarks.resharding                       # tiny model, TP2 -> TP1 DP2
    .venv/bin/python -m rldock_benchmarks.resharding --model 100m --iterations 2

Each of `--world` gloo ranks (torch.multiprocessing, CPU) trains a Qwen2 model with the training
layout, reshards to the generation layout every iteration, then brings the state back, in both
modes in the same run. There is no engine: the generation side is `GenerationWeights` (the
weights an engine would hold) and the "inference" stage is one no-grad forward on the training
model, overlapping the background swap-in, as old-log-prob inference does in the actor.

Memory is the ledger's (see `rldock.runtime.resharding.ledger`): on CPU, logical placement, not
RSS. It is compared with the paper's Eq. (3), R = GDP * (TW/UTP + EW/GEP), read here as the weight
bytes that one generation replica per DP rank holds in naive mode: TW training weights and EW
generation weights (both the full model in bytes), UTP the training TP size, GEP the generation
TP size (no expert parallelism here), GDP the generation DP size. Swap D2H / H2D are timed on the
whole training state against a plain copy of the same number of bytes between two preallocated
buffers (pinned on an accelerator) in the same process, as a ratio.
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

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODELS = {
    # vocab, hidden, layers, heads, kv heads, intermediate
    "tiny": dict(
        vocab_size=64,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
    ),
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
    ),
}


def build_model(size: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**MODELS[size], max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_mode(args, mode: str, rank: int) -> dict:
    from rldock.contract.tensor_parallel import TP_PLANS
    from rldock.runtime.resharding.flow import Resharder
    from rldock.runtime.resharding.ledger import train_state_bytes
    from rldock.runtime.resharding.parallel_layout import ParallelLayout, ReshardPlan
    from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh
    from rldock.runtime.resharding.parallelize import apply_gradients, parallelize_decoder
    from rldock.runtime.resharding.shard import GenerationWeights

    plan = ReshardPlan(
        train=ParallelLayout(args.train_tp, args.world // args.train_tp),
        generate=ParallelLayout(args.gen_tp, args.world // args.gen_tp),
    )
    mesh = ParallelMesh(MeshShape(dp=plan.train.dp_size, tp=plan.train.tp_size), "cpu")
    model = parallelize_decoder(build_model(args.model), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    generation = GenerationWeights(
        shapes,
        dtype=torch.float32,
        device=torch.device("cpu"),
        tp_rank=plan.generate.tp_rank(rank),
        tp_size=args.gen_tp,
        plan=TP_PLANS[model.config.model_type],
    )
    resharder = Resharder(
        model=model,
        optimizer=optimizer,
        mesh=mesh,
        plan=plan,
        rank=rank,
        mode=mode,
        bucket_bytes=args.bucket_mb << 20,
        load_weights=generation.load,
        generation_tensors=lambda: generation.tensors.values(),
    )
    vocab = model.config.vocab_size
    iterations = []
    for iteration in range(args.iterations):
        tokens = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(iteration))

        def train_step(tokens=tokens):
            optimizer.zero_grad(set_to_none=True)
            model(input_ids=tokens, labels=tokens).loss.backward()
            apply_gradients(model, optimizer, mesh, max_grad_norm=1.0)

        dist.barrier()
        step_s = _seconds(train_step)
        start = time.perf_counter()
        to_gen = resharder.to_generation()
        to_gen_s = time.perf_counter() - start
        start = time.perf_counter()
        back = resharder.begin_update()
        with torch.no_grad():
            model(input_ids=tokens)
        infer_s = time.perf_counter() - start - back.get("swap_in_params_s", 0.0)
        wait = resharder.finish_update_swap()
        reshard_s = to_gen_s + back.get("swap_in_params_s", 0.0) + wait.get("swap_in_wait_s", 0.0)
        iterations.append(
            {
                "train_step_s": step_s,
                "inference_s": infer_s,
                "reshard_s": reshard_s,
                "reshard_share": reshard_s / (step_s + infer_s + reshard_s),
                **to_gen,
                **back,
                **wait,
            }
        )
    generation_rows = [e for e in resharder.ledger if e["stage"] == "generation"]
    peak = max(generation_rows, key=lambda e: sum(e["device_bytes"].values()))
    result = {
        "iterations": iterations,
        "generation_ledger": peak["device_bytes"],
        "generation_device_bytes": sum(peak["device_bytes"].values()),
        "generation_train_state_bytes": train_state_bytes(peak),
        "train_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "generation_weight_bytes": generation.nbytes,
    }
    if mode == "allgather_swap":
        result["swap"] = time_swaps(args, resharder, model, optimizer)
    return result


def time_swaps(args, resharder, model, optimizer) -> dict:
    """D2H and H2D of the whole training state vs a plain copy of the same bytes (median of repeats)."""
    from rldock.runtime.resharding.swap import training_state

    swapper = resharder.swapper
    d2h, h2d, nbytes = [], [], 0
    for _ in range(args.repeats):
        state = training_state(model, optimizer)
        start = time.perf_counter()
        nbytes = swapper.swap_out(state)
        d2h.append(time.perf_counter() - start)
        h2d.append(_seconds(swapper.swap_in))
    device_side = torch.empty(nbytes, dtype=torch.uint8)
    device_side.fill_(1)
    host_side = torch.empty(nbytes, dtype=torch.uint8)  # pinned on an accelerator; CPU cannot pin
    host_side.fill_(1)
    plain_d2h = statistics.median(_seconds(lambda: host_side.copy_(device_side)) for _ in range(args.repeats))
    plain_h2d = statistics.median(_seconds(lambda: device_side.copy_(host_side)) for _ in range(args.repeats))
    # Swapping in allocates the device memory again (the swap-out gave it back); on CPU that is
    # fresh pages from the kernel, so a copy into a newly allocated buffer is the second baseline.
    device_side = None  # its memory back before the fresh allocations below
    fresh_h2d = statistics.median(
        _seconds(lambda: torch.empty_like(host_side).copy_(host_side)) for _ in range(args.repeats)
    )
    d2h_s, h2d_s = statistics.median(d2h), statistics.median(h2d)
    return {
        "bytes": nbytes,
        "d2h_s": d2h_s,
        "h2d_s": h2d_s,
        "plain_copy_d2h_s": plain_d2h,
        "plain_copy_h2d_s": plain_h2d,
        "d2h_vs_plain": d2h_s / plain_d2h,
        "h2d_vs_plain": h2d_s / plain_h2d,
        "fresh_alloc_copy_h2d_s": fresh_h2d,
        "h2d_vs_fresh_alloc_copy": h2d_s / fresh_h2d,
        "d2h_gb_per_s": nbytes / d2h_s / 1e9,
        "h2d_gb_per_s": nbytes / h2d_s / 1e9,
    }


def worker(rank: int, args, port: int, out_dir: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world)
    results = {mode: run_mode(args, mode, rank) for mode in ("naive", "allgather_swap")}
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


def eq3(args, train_weight_bytes_full: int, generation_weight_bytes_full: int) -> dict:
    gen_dp = args.world // args.gen_tp
    per_rank_naive = train_weight_bytes_full / args.train_tp + generation_weight_bytes_full / args.gen_tp
    return {
        "GDP": gen_dp,
        "UTP": args.train_tp,
        "GEP": args.gen_tp,
        "TW": train_weight_bytes_full,
        "EW": generation_weight_bytes_full,
        "R_naive": gen_dp * per_rank_naive,
        "R_swap": gen_dp * generation_weight_bytes_full / args.gen_tp,
    }


def summarize(args, ranks: list[dict]) -> dict:
    from rldock.runtime.resharding.parallel_layout import ParallelLayout

    generate = ParallelLayout(args.gen_tp, args.world // args.gen_tp)
    replicas = [r for r in range(args.world) if generate.tp_rank(r) == 0]  # one rank per generation replica
    model = build_model(args.model)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prediction = eq3(args, full_bytes, full_bytes)
    out = {
        "model": args.model,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "layout": f"train TP{args.train_tp} DP{args.world // args.train_tp} -> "
        f"generate TP{args.gen_tp} DP{args.world // args.gen_tp}",
        "machine": {"cpus": os.cpu_count(), "torch_threads_per_rank": args.threads, "device": "cpu"},
        "eq3": prediction,
    }
    for mode in ("naive", "allgather_swap"):
        per_rank = [ranks[r][mode] for r in range(args.world)]
        weights = sum(
            per_rank[r]["generation_ledger"]["train_params"] + per_rank[r]["generation_ledger"]["generation_weights"]
            for r in replicas
        )
        iterations = [it for rank in per_rank for it in rank["iterations"][1:] or rank["iterations"]]
        out[mode] = {
            "peak_generation_device_bytes_per_rank": [r["generation_device_bytes"] for r in per_rank],
            "generation_ledger_rank0": per_rank[0]["generation_ledger"],
            "generation_train_state_bytes_per_rank": [r["generation_train_state_bytes"] for r in per_rank],
            "weight_bytes_over_generation_replicas": weights,
            "vs_eq3": weights / prediction["R_naive" if mode == "naive" else "R_swap"],
            "reshard_s_median": statistics.median(it["reshard_s"] for it in iterations),
            "reshard_share_median": statistics.median(it["reshard_share"] for it in iterations),
            "iterations_rank0": per_rank[0]["iterations"],
        }
        if mode == "allgather_swap":
            out[mode]["swap_rank0"] = per_rank[0]["swap"]
    naive_peak = max(out["naive"]["peak_generation_device_bytes_per_rank"])
    swap_peak = max(out["allgather_swap"]["peak_generation_device_bytes_per_rank"])
    out["peak_ratio_swap_over_naive"] = swap_peak / naive_peak
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--train-tp", type=int, default=2)
    parser.add_argument("--gen-tp", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="timed swap round trips")
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args(argv)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(worker, args=(args, port, out_dir), nprocs=args.world)
        ranks = []
        for rank in range(args.world):
            with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    json.dump(summarize(args, ranks), sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
