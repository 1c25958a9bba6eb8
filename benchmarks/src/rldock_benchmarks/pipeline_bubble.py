"""The pipeline's bubble on the CPU: the share of an update step a stage sits idle under the 1F1B schedule,
measured against (p - 1) / (m + p - 1), for m micro-batches at p stages. Prints one JSON document.

    .venv/bin/python -m rldock_benchmarks.pipeline_bubble                  # p 2, m 2..8
    .venv/bin/python -m rldock_benchmarks.pipeline_bubble --micro-batches 2 4 --steps 5

The ranks are fresh gloo processes (torch.multiprocessing, one torch thread each), one per stage, laid out
as a job's PP p x DP 1 update through `rldock train`'s own code: the FSDP backend cuts a Qwen2-style model
(float32, sdpa, 8 layers) into stages (training/pipeline.py) and `accumulate` runs m micro-batches of one
sequence each on its 1F1B schedule, then clips and steps AdamW: the update step.

Measured per stage (a step after the first; the median over `--steps` steps):
- `step_seconds`: the step's wall time (from the first forward to the last backward's end, the clip and
  the optimizer step left out: they do not pipeline);
- `busy_seconds`: the time the stage computed: each forward less the time it waited for its input
  activations (`StageLinks.receive`, wrapped in the rank: a measuring wrapper, benchmark only), plus each
  backward;
- `bubble`: 1 - busy / step, against `expected_bubble` (p - 1) / (m + p - 1), which assumes stages of equal
  cost and free sends. The stages here differ by the embedding and the LM head, and a send costs a copy
  through gloo, so the measured share runs above the formula; how it falls with m is the schedule's.

p stages need p cores to run side by side: on this machine's 2 cores, p 2 is the figure to read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPE = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
)
PROMPT, RESPONSE = 64, 64


def _micro_batches(count: int):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(4, SHAPE["vocab_size"], (count, PROMPT), generator=g),
        "prompt_mask": torch.ones(count, PROMPT, dtype=torch.int64),
        "response_ids": torch.randint(4, SHAPE["vocab_size"], (count, RESPONSE), generator=g),
        "response_mask": torch.ones(count, RESPONSE, dtype=torch.int64),
    }
    rows = TensorDict(batch, batch_size=[count])
    return [rows[i : i + 1] for i in range(count)]


def _bubble_row(rank: int, stages: int, count: int, steps: int, waited: list[float]) -> dict:
    """One stage's median step and busy time at `count` micro-batches (module docstring); `waited` is the
    receive wrapper's running total."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.policy import response_logprobs
    from rldock.runtime.training.accumulation import accumulate
    from rldock.runtime.training.fsdp import FsdpBackend
    from rldock_e2e.moe_fixture import ep_job_config

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, attn_implementation="sdpa")).eval()
    backend = FsdpBackend(
        ep_job_config(stages, 1, pipeline_parallel_size=stages),  # the backend reads the layout only
        model=model,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-5),
        device=detect_device("cpu"),
        rank=rank,
    )
    micro_batches = _micro_batches(count)
    busy_backward = [0.0]
    accumulating = backend.accumulating

    class TimedBackward:
        def __init__(self, last: bool) -> None:
            self.inner = accumulating(last=last)

        def __enter__(self):
            self.start = time.perf_counter()
            return self.inner.__enter__()

        def __exit__(self, *exc):
            result = self.inner.__exit__(*exc)
            busy_backward[0] += time.perf_counter() - self.start
            return result

    backend.accumulating = lambda *, last: TimedBackward(last)  # type: ignore[method-assign]
    forward_seconds = [0.0]

    def micro_loss(micro):
        start = time.perf_counter()
        logprobs = response_logprobs(
            backend.model,
            micro["prompt_ids"],
            micro["prompt_mask"],
            micro["response_ids"],
            micro["response_mask"],
            micro_batch_size=1,
        )
        forward_seconds[0] += time.perf_counter() - start
        loss = logprobs.sum() * 1e-3
        return loss, {}

    step = backend.step
    step_ends = [0.0]

    def timed_step(max_grad_norm: float) -> float:
        step_ends[0] = time.perf_counter()  # the schedule's end: the clip and the step do not pipeline
        return step(max_grad_norm)

    backend.step = timed_step  # type: ignore[method-assign]
    measured = []
    for index in range(steps + 1):
        dist.barrier()
        waited[0] = forward_seconds[0] = busy_backward[0] = 0.0
        start = time.perf_counter()
        accumulate(backend, micro_batches, micro_loss, max_grad_norm=1.0)
        wall = step_ends[0] - start
        busy = forward_seconds[0] - waited[0] + busy_backward[0]
        if index:  # the first step allocates AdamW's state and warms the caches
            measured.append((wall, busy))
    wall = statistics.median(w for w, _ in measured)
    busy = statistics.median(b for _, b in measured)
    return dict(micro_batches=count, stage=rank, step_seconds=wall, busy_seconds=busy, bubble=1 - busy / wall)


def _rank(rank: int, stages: int, micro_batch_counts: list[int], steps: int, rendezvous: str, out: str) -> None:
    from rldock.runtime.models.pipeline_stage import StageLinks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=stages)
    waited = [0.0]
    receive = StageLinks.receive

    def timed_receive(self, tokens):  # the measuring wrapper: time spent waiting for the input activations
        start = time.perf_counter()
        try:
            return receive(self, tokens)
        finally:
            waited[0] += time.perf_counter() - start

    StageLinks.receive = timed_receive  # type: ignore[method-assign]
    rows = [_bubble_row(rank, stages, count, steps, waited) for count in micro_batch_counts]
    torch.save(rows, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def measure(stages: int, micro_batch_counts: list[int], steps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(stages, micro_batch_counts, steps, str(Path(out) / "rendezvous"), out), nprocs=stages)
        per_rank = [torch.load(Path(out) / f"rank{r}.pt") for r in range(stages)]
    rows = []
    for index, count in enumerate(micro_batch_counts):
        stages_rows = [ranks[index] for ranks in per_rank]
        expected = (stages - 1) / (count + stages - 1)
        bubbles = [row["bubble"] for row in stages_rows]
        rows.append(
            dict(
                stages=stages,
                micro_batches=count,
                expected_bubble=round(expected, 4),
                bubble_mean=round(statistics.mean(bubbles), 4),
                bubble_per_stage=[round(b, 4) for b in bubbles],
                step_seconds=round(max(row["step_seconds"] for row in stages_rows), 4),
                busy_seconds_per_stage=[round(row["busy_seconds"], 4) for row in stages_rows],
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    rows = measure(args.stages, args.micro_batches, args.steps)
    print(
        json.dumps(
            {"benchmark": "pipeline_bubble", "shape": SHAPE, "tokens_per_micro_batch": PROMPT + RESPONSE, "rows": rows},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
