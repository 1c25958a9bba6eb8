"""Ulysses context parallelism on the CPU: update time, memory per rank and all-to-all bytes against
sequence length at CP 1, 2 and 4, beside the memory planner's figures for the same pass. Prints one
JSON document.

    .venv/bin/python -m rldock_benchmarks.context_parallel                       # 512..2048 tokens
    .venv/bin/python -m rldock_benchmarks.context_parallel --lengths 1024 4096 --cp 1 2

Each (CP size, length) runs in fresh gloo ranks (torch.multiprocessing, one torch thread each): a
Qwen2-style model (float32, sdpa) with the runtime's Ulysses attention (`apply_context_parallel`)
scores one sequence of that many tokens (a prompt of a quarter of them and a response) through the
policy's own pass (`response_logprobs_and_entropy`), backpropagates a loss on the logprobs, sums the
gradients over the CP group (what FSDP's reduction does in a job) and steps AdamW: the update step.
CP 1 is the same pass without CP, the baseline, in the same run.

Measured per rank, on the last of `--steps` steps:
- `saved_bytes`: the distinct storages autograd saves for the backward during the pass (weights
  left out), counted with saved-tensor hooks: what the planner's activation formula estimates;
- `rss_held_bytes`: resident memory after the forward minus before it (/proc/self/statm): what the
  process holds for the backward as the OS sees it; after the first step the allocator reuses freed
  memory without the OS seeing it, so this undercounts, by an amount that varies with the length;
- `peak_rss_bytes`: the process's peak resident memory (getrusage) less its resident memory once the
  model is built: activations, the transient attention and LM-head buffers, gradients and AdamW state
  (this benchmark shards no weights, so those do not fall with CP);
- `all_to_all_bytes`: what the rank sent other ranks through the all-to-alls of one step, counted by
  wrapping torch.distributed.all_to_all_single in the rank (a measuring wrapper, benchmark only);
- `seconds`: the median step after the first. The CP ranks share this machine's cores with each
  other and with whatever else runs, so CP does not make a step faster here: the figure shows what
  the exchange costs, not the speed-up of ranks on devices of their own.

The planner's figures for the same pass are printed beside, with the measured/planned ratios:
`planned_saved_bytes` (planning/memory.py `activation_bytes` for a job of micro-batch 1 and this
length, less the LM head's transient chunk `head_chunk_bytes`: what autograd keeps),
`planned_activation_bytes` (with it) and `planned_all_to_all_bytes` (planning/context_parallel.py).
`saved_vs_cp1` against `planned_vs_cp1` is how memory per rank falls with CP, measured and planned.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def _model(dtype: str = "float32"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, attn_implementation="sdpa")).to(getattr(torch, dtype)).train()


def _batch(length: int) -> dict[str, torch.Tensor]:
    prompt, response = length // 4, length - length // 4
    g = torch.Generator().manual_seed(length)
    return dict(
        prompt_ids=torch.randint(4, SHAPE["vocab_size"], (1, prompt), generator=g),
        prompt_mask=torch.ones(1, prompt, dtype=torch.int64),
        response_ids=torch.randint(4, SHAPE["vocab_size"], (1, response), generator=g),
        response_mask=torch.ones(1, response, dtype=torch.int64),
    )


def _rss() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


class _SavedBytes:
    """Saved-tensor hooks counting the distinct storages autograd keeps, the model's weights left out."""

    def __init__(self, model: torch.nn.Module):
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.weights and pointer not in self.seen and storage.nbytes():
            self.seen.add(pointer)
            self.bytes += storage.nbytes()
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _rank(rank: int, cp: int, length: int, steps: int, dtype: str, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.engines.policy import response_logprobs_and_entropy
    from rldock.runtime.training.context_parallel import apply_context_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=cp)
    sent = [0]
    exchange = dist.all_to_all_single

    def counting_all_to_all(output, input, *args, **kwargs):  # noqa: A002 (torch's parameter name)
        sent[0] += input.numel() * input.element_size() * (cp - 1) // cp  # the chunks for other ranks
        return exchange(output, input, *args, **kwargs)

    dist.all_to_all_single = counting_all_to_all  # type: ignore[assignment]  # the measuring wrapper
    model = _model(dtype)
    group = apply_context_parallel(model, cp)
    baseline = _rss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = _batch(length)
    times, record = [], {}
    for _ in range(steps):
        sent[0] = 0
        saved = _SavedBytes(model)
        dist.barrier()
        start = time.perf_counter()
        before = _rss()
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            scores = response_logprobs_and_entropy(model, **batch, micro_batch_size=1, trim=True)
        held = _rss() - before
        loss = -scores.logprobs.sum() / batch["response_mask"].sum()
        loss.backward()
        if group is not None:  # the CP group's gradient shares summed, as FSDP's reduction does in a job
            for param in model.parameters():
                dist.all_reduce(param.grad, group=group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        record = dict(saved_bytes=saved.bytes, rss_held_bytes=held, all_to_all_bytes=sent[0], loss=float(loss.detach()))
    record["seconds"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    record["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def planned(length: int, cp: int) -> dict[str, int]:
    """The planner's activations and all-to-all bytes for one rank of this pass."""
    from rldock.config import parse_job_config
    from rldock.runtime.planning.context_parallel import all_to_all_bytes_per_pass
    from rldock.runtime.planning.memory import activation_bytes, head_chunk_bytes
    from rldock.runtime.planning.shapes import shape_from_hf_config

    cfg = parse_job_config(
        {
            "iterations": 1,
            "model": {"path": "unused", "dtype": "float32"},
            "data": {"generator": {"name": "addition"}},
            "reward": {"terms": [{"name": "digit_match"}]},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": 1,
                "num_responses_per_prompt": 2,
                "max_prompt_length": length // 4,
                "max_response_length": length - length // 4,
                "learning_rate": 1e-4,
            },
            "training": {"strategy": "fsdp", "micro_batch_size": 1, "context_parallel_size": cp},
            "resources": {"device": "cpu", "devices_per_node": cp},
        }
    )
    shape = shape_from_hf_config({**SHAPE, "model_type": "qwen2"}, name="bench")
    return {
        "planned_saved_bytes": activation_bytes(cfg, shape) - head_chunk_bytes(cfg, shape),
        "planned_activation_bytes": activation_bytes(cfg, shape),
        "planned_all_to_all_bytes": all_to_all_bytes_per_pass(shape, tokens=length, cp=cp, element=4),
    }


def run(cp: int, length: int, steps: int, *, dtype: str = "float32") -> dict:
    """One (CP size, length) in fresh ranks. `dtype` other than float32 (the planner's figures' dtype)
    is for comparing the CP sizes' losses: float64 sums in any order agree to ~1e-12."""
    with tempfile.TemporaryDirectory() as out:
        # a file rendezvous in this run's fresh directory: a probed free port could be taken before rank 0 binds it
        mp.spawn(_rank, args=(cp, length, steps, dtype, str(Path(out) / "rendezvous"), out), nprocs=cp)
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(cp)]
    plan = planned(length, cp)
    keys = ("saved_bytes", "rss_held_bytes", "peak_rss_bytes", "all_to_all_bytes")
    worst = {key: max(r[key] for r in ranks) for key in keys}
    return {
        "cp": cp,
        "tokens": length,
        "seconds": max(r["seconds"] for r in ranks),
        "loss": ranks[0]["loss"],
        **{f"max_rank_{key}": value for key, value in worst.items()},
        **plan,
        "saved_over_planned": worst["saved_bytes"] / plan["planned_saved_bytes"],
        "rss_held_over_planned": worst["rss_held_bytes"] / plan["planned_saved_bytes"],
        "all_to_all_over_planned": (
            worst["all_to_all_bytes"] / plan["planned_all_to_all_bytes"] if plan["planned_all_to_all_bytes"] else None
        ),
    }


def summarize(rows: list[dict]) -> dict:
    """Per length, each CP size's memory and time relative to CP 1 of the same run."""
    by = {(row["cp"], row["tokens"]): row for row in rows}
    for row in rows:
        base = by.get((1, row["tokens"]))
        if base is not None:
            row["saved_vs_cp1"] = row["max_rank_saved_bytes"] / base["max_rank_saved_bytes"]
            row["planned_vs_cp1"] = row["planned_saved_bytes"] / base["planned_saved_bytes"]
            row["fall_vs_planned_error"] = row["saved_vs_cp1"] / row["planned_vs_cp1"] - 1
            row["peak_rss_vs_cp1"] = row["max_rank_peak_rss_bytes"] / base["max_rank_peak_rss_bytes"]
            row["seconds_vs_cp1"] = row["seconds"] / base["seconds"]
    return {
        "benchmark": "context_parallel",
        "model": SHAPE,
        "threads_per_rank": 1,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "rows": rows,
        "max_saved_vs_planned_error": max(abs(row["saved_over_planned"] - 1) for row in rows),
        "max_fall_vs_planned_error": max(abs(row.get("fall_vs_planned_error", 0.0)) for row in rows),
        "max_all_to_all_vs_planned_error": max(
            (abs(row["all_to_all_over_planned"] - 1) for row in rows if row["all_to_all_over_planned"] is not None),
            default=0.0,
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = [run(cp, length, args.steps) for length in args.lengths for cp in args.cp]
    print(json.dumps(summarize(rows), indent=1))


if __name__ == "__main__":
    main()
