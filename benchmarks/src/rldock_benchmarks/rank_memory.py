"""What one training rank holds in an update step, measured on gloo ranks on the CPU: the helpers the memory
benchmarks share (rldock_benchmarks.context_parallel, layout_memory), and the ranks they run in.

- `state_bytes`: the training state a rank holds, summed from its tensors (parameter shards, gradients
  where they exist, AdamW's state);
- `peak_allocated`: the highest running sum of a profiled window's tensor allocations and frees (torch's
  profiler with `profile_memory`), in time order: the peak above what was live when it began, what a
  device allocator's peak reports (torch.cuda.max_memory_allocated), free of the process's RSS and slack;
- `SavedBytes`: saved-tensor hooks counting what autograd keeps for the backward, the weights left out;
- `spawned_ranks`, `joined_group`: fresh processes (torch.multiprocessing) joined in one gloo group
  through a file rendezvous, one torch thread each;
- `SHAPE`, `model`: the Qwen2-style model the memory benchmarks measure (float32, sdpa, untied
  embeddings; TP 2, Ulysses CP 2 and 4 split its 8 heads and 4 KV heads), `model_shape` its planner shape;
- `update_config`: the job config of the measured update, for the planner's figures beside them;
  `planned_peak`: the planner's update peak on one rank of it; `worst_errors`: the rows' largest
  disagreements with it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if TYPE_CHECKING:
    from rldock.config import JobConfig
    from rldock.runtime.planning.shapes import ModelShape

SHAPE: dict[str, Any] = dict(
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


def model(dtype: str = "float32") -> torch.nn.Module:
    """`SHAPE`'s model, seeded (every rank builds the same weights), in training mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, attn_implementation="sdpa")).to(getattr(torch, dtype)).train()


def model_shape() -> ModelShape:
    """`SHAPE` as the planner reads it."""
    from rldock.runtime.planning.shapes import shape_from_hf_config

    return shape_from_hf_config({**SHAPE, "model_type": "qwen2"}, name="bench")


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's (an FSDP shard's, a TP slice's) local tensor; any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The training state's tensor bytes on this rank: its parameter shards, their gradients where
    they exist, and AdamW's state."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(local(t).untyped_storage().nbytes() for t in tensors)


def peak_allocated(profiler) -> int:
    """The highest running sum of the tensor allocations (and frees, negative) a profiled window made,
    in time order: the peak above what was live when it began."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int]] = []
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.alloc_size))
        stack.extend(event.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


class _Kept:
    """A saved tensor as autograd holds it between the forward and the backward; its storage is let go
    (in `SavedBytes.live`) when the last holder of it is."""

    __slots__ = ("key", "owner", "tensor")

    def __init__(self, tensor: torch.Tensor, owner: SavedBytes, key: int) -> None:
        self.tensor, self.owner, self.key = tensor, owner, key

    def __del__(self) -> None:
        self.owner.release(self.key)


class SavedBytes:
    """Saved-tensor hooks counting the distinct storages autograd keeps, the model's weights left out:
    under FSDP those are the layer's gathered weights, registered on the model while it computes, so
    they are looked up when a tensor is saved (a DTensor's by its local tensor: a shard, or a TP slice).

    `bytes`: every storage saved while the hooks were on; `peak_live`: the most held at once, each let go
    when autograd frees the last tensor it saved of it (a graph's backward, or the graph dropped): what a
    schedule that runs several micro-batches' forwards before their backwards holds."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.seen: set[int] = set()
        self.bytes = 0
        self.holders: dict[int, tuple[int, int]] = {}  # storage address -> (its holders, its bytes)
        self.live = self.peak_live = 0

    def weights(self) -> set[int]:
        return {local(p).untyped_storage().data_ptr() for p in self.model.parameters()}

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = local(tensor).untyped_storage()
        pointer, size = storage.data_ptr(), storage.nbytes()
        if not size or pointer in self.weights():
            return tensor
        if pointer not in self.seen:
            self.seen.add(pointer)
            self.bytes += size
        holders, _ = self.holders.get(pointer, (0, size))
        if not holders:
            self.live += size
            self.peak_live = max(self.peak_live, self.live)
        self.holders[pointer] = (holders + 1, size)
        return _Kept(tensor, self, pointer)

    def release(self, pointer: int) -> None:
        holders, size = self.holders[pointer]
        if holders == 1:
            del self.holders[pointer]
            self.live -= size
        else:
            self.holders[pointer] = (holders - 1, size)

    @staticmethod
    def unpack(kept: Any) -> torch.Tensor:
        return kept.tensor if isinstance(kept, _Kept) else kept


@contextmanager
def spawned_ranks(target: Callable[..., None], nprocs: int, *args: Any) -> Iterator[Path]:
    """Run `target(rank, *args, rendezvous, out_dir)` in `nprocs` fresh processes and yield `out_dir`, where
    they wrote what they measured (a temporary directory, removed after)."""
    with tempfile.TemporaryDirectory() as out:
        # a file rendezvous in this run's fresh directory: a probed free port could be taken before rank 0 binds it
        mp.spawn(target, args=(*args, str(Path(out) / "rendezvous"), out), nprocs=nprocs)
        yield Path(out)


@contextmanager
def joined_group(rank: int, world_size: int, rendezvous: str) -> Iterator[None]:
    """This process as `rank` of a gloo group of `world_size` (one torch thread, so ranks sharing cores do
    not oversubscribe them), left once every rank is done."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
        dist.destroy_process_group()


def update_config(*, prompt_length: int, response_length: int, samples: int, devices: int, **training) -> JobConfig:
    """A GRPO job of `samples` sequences an iteration (two responses a prompt) of these lengths, float32, on
    `devices` CPU ranks, with `training`'s fields: the update a benchmark measures, as the planner sees it."""
    from rldock.config import parse_job_config

    return parse_job_config(
        {
            "iterations": 1,
            "model": {"path": "unused", "dtype": "float32"},
            "data": {"generator": {"name": "addition"}},
            "reward": {"terms": [{"name": "digit_match"}]},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": samples // 2,
                "num_responses_per_prompt": 2,
                "max_prompt_length": prompt_length,
                "max_response_length": response_length,
                "learning_rate": 1e-4,
            },
            "training": {"strategy": "fsdp", "micro_batch_size": 1, **training},
            "resources": {"device": "cpu", "devices_per_node": devices},
        }
    )


def planned_peak(cfg: JobConfig, shape: ModelShape, *, stage: int = 0) -> int:
    """The planner's update peak on one rank of pipeline stage `stage` (0 without PP), the engine left out:
    its stage's params, gradients and AdamW state, FSDP's gathered layers and whole gradients, and the
    stage's activations, composed as `plan_memory`'s update phase composes them (which, under PP, takes
    each term's fullest stage, a bound for every stage's device)."""
    from rldock.runtime.planning.memory import (
        fsdp_gathered_bytes,
        fsdp_whole_gradient_bytes,
        stage_activation_bytes,
        stage_training_state_bytes,
    )

    return (
        sum(stage_training_state_bytes(cfg, shape, stage))
        + fsdp_gathered_bytes(cfg, shape)
        + fsdp_whole_gradient_bytes(cfg, shape)
        + stage_activation_bytes(cfg, shape, stage)
    )


def worst_errors(rows: list[dict]) -> dict[str, float]:
    """The run's context (cores, load) and its rows' largest disagreements with the planner: each row's
    `peak_over_planned` and `saved_over_planned`, and where a row has them its `peak_fall_vs_planned_error`
    and `saved_fall_vs_planned_error` (how it falls from the run's baseline, over the planner's fall)."""
    return {
        "threads_per_rank": 1,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg(),
        "max_peak_vs_planned_error": max(abs(row["peak_over_planned"] - 1) for row in rows),
        "max_peak_fall_vs_planned_error": max(abs(row.get("peak_fall_vs_planned_error", 0.0)) for row in rows),
        "max_saved_vs_planned_error": max(abs(row["saved_over_planned"] - 1) for row in rows),
        "max_saved_fall_vs_planned_error": max(abs(row.get("saved_fall_vs_planned_error", 0.0)) for row in rows),
    }
