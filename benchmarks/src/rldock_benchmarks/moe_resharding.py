"""The paper's eq. 3 with experts, measured: the training weights naive resharding leaves on the devices
during generation for the tiny MoE at EP x FSDP, beside the planner's figure. Prints one JSON document.

    .venv/bin/python -m rldock_benchmarks.moe_resharding > moe-resharding.json

For each layout (EP 2 over 2 FSDP ranks, as examples/grpo-tiny-moe.yaml; EP 2 over 4; PP 2 of 2 FSDP ranks
each, EP 2 within a stage) and each of `training.resharding` naive and allgather_swap, gloo ranks
(torch.multiprocessing, CPU) build the actor's FSDP backend on the tiny Qwen3-MoE the demo builds
(tiny-qwen3-moe), take one AdamW step (not under PP, whose forward is the pipeline schedule's: there the
weights are measured as loaded, and the gradients and moments are not), push the whole weights out
(`to_generation`, into a dict standing for the engine) and read the memory ledger's `generation` row
(resharding/ledger.py: logical placement on CPU). The measured R is the training parameters' bytes on
the generation replicas' devices (each engine's first rank, one engine per rank at
rollout.tensor_parallel_size 1), summed; the planner's is `plan_redundant_weights` (planning/memory.py:
`naive_bytes`, and the paper's form `paper_bytes`). The training state beside the weights (gradients,
AdamW moments) is reported too: naive resharding keeps it as well, though eq. 3 counts weights only.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import uuid
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = "examples/grpo-tiny-moe.yaml"
LAYOUTS = ((2, 2, 1), (4, 2, 1), (4, 2, 2))  # (ranks, EP, PP): a stage's FSDP ranks are ranks / PP
MODES = ("naive", "allgather_swap")
TEXTS = ["1+2=3", "4+5=9", "3+3=6 #### 6"]


def job_config(model_path: str, world: int, ep: int, mode: str, pp: int = 1):
    """The demo MoE job on `world` ranks (`pp` stages of world / pp FSDP ranks), EP `ep` and resharding `mode`."""
    import yaml

    from rldock.config import parse_job_config

    data = yaml.safe_load(Path(CONFIG).read_text())
    data["model"] = {"path": model_path, "dtype": "float32"}
    data["training"].update(
        data_parallel_size=world // pp, expert_parallel_size=ep, pipeline_parallel_size=pp, resharding=mode
    )
    data["resources"]["devices_per_node"] = world
    return parse_job_config(data)


def rank_main(rank: int, world: int, ep: int, pp: int, mode: str, model_path: str, rendezvous: str, out: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.models.loading import load_causal_lm
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)
    model = load_causal_lm(Path(model_path))
    backend = FsdpBackend(
        job_config(model_path, world, ep, mode, pp),
        model=model,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
        device=detect_device("cpu"),
        rank=rank,
    )
    if pp == 1:
        tokens = torch.randint(0, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
        backend.model(input_ids=tokens, labels=tokens).loss.backward()
        backend.step(1.0)
    backend.to_generation(lambda weights: [None for _ in weights])  # the engine's push, consumed to the end
    ledger = backend.drain_metrics()["ledger"]
    torch.save(ledger, Path(out) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, ep: int, mode: str, model_path: str, pp: int = 1) -> dict:
    from rldock.config.job_layout import job_layout

    with tempfile.TemporaryDirectory() as out:
        rendezvous = f"file://{out}/rendezvous-{uuid.uuid4().hex}"
        mp.spawn(rank_main, args=(world, ep, pp, mode, model_path, rendezvous, out), nprocs=world)
        ledgers = [torch.load(Path(out) / f"rank{rank}.pt") for rank in range(world)]
    engines = job_layout(job_config(model_path, world, ep, mode, pp)).engine_ranks

    def total(category: str, ranks) -> int:
        return sum(ledgers[r][f"memory/rank{r}/generation/{category}"] for r in ranks)

    return {
        "measured_R": total("train_params", engines),
        "engine_ranks": list(engines),
        "train_params_per_rank": [ledgers[r][f"memory/rank{r}/generation/train_params"] for r in range(world)],
        "grads_and_optimizer_on_engine_ranks": total("grads", engines) + total("optimizer_state", engines),
        "host_swap_per_rank": [ledgers[r][f"memory/rank{r}/generation/host_swap"] for r in range(world)],
    }


def main() -> None:
    from rldock.runtime.models import MODEL_BUILDERS
    from rldock.runtime.planning.memory import plan_redundant_weights
    from rldock.runtime.planning.shapes import shape_from_hf_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(Path(tmp) / "tiny-qwen3-moe")
        MODEL_BUILDERS.get("tiny-qwen3-moe")(Path(model_path), texts=TEXTS, seed=0)
        config = json.loads((Path(model_path) / "config.json").read_text())
        shape = shape_from_hf_config(config, name="tiny-qwen3-moe")
        results = []
        for world, ep, pp in LAYOUTS:
            planned = plan_redundant_weights(job_config(model_path, world, ep, "naive", pp), shape)
            runs = {mode: measure(world, ep, mode, model_path, pp) for mode in MODES}
            stages = f"PP {pp} x " if pp > 1 else ""
            results.append(
                {
                    "layout": f"{stages}FSDP {world // pp} x EP {ep}, rollout TP 1",
                    "stepped": pp == 1,
                    "planner": asdict(planned),
                    "naive": runs["naive"],
                    "allgather_swap": runs["allgather_swap"],
                    "naive_measured_over_planned": runs["naive"]["measured_R"] / planned.naive_bytes,
                }
            )
    print(json.dumps({"config": CONFIG, "model": "tiny-qwen3-moe", "layouts": results}, indent=2))


if __name__ == "__main__":
    main()
