"""Issue 38's cost on a device: an actor and a reference model sharing one GPU, in one process or in
two (`gpu_checks --checks processes`).

Both layouts run the same iteration: the reference scores the batch (the product's passes, no
gradients), its logprobs are copied into a host tensor in shared memory (the dock's columns live in
host memory in both of the product's layouts), and the actor copies them back to the device and
updates against them (`gpu_checks.PolicyUpdate`). In `one_process` both models live in one
process, the device worker's layout; in `two_processes` the reference is a process of its own that
the actor wakes through a pipe and waits for, one process per seat. Reported per layout: the
median seconds per iteration (the actor's clock), the device memory in use as the driver counts it
(contexts included), and what each process's caching allocator holds.
"""

from __future__ import annotations

import statistics
import subprocess
import time

# a layout's processes start, warm up and run their iterations well inside this (about 20 s on an
# H100, a minute on the CPU with one layer); past it they are stopped and the check fails
LAYOUT_DEADLINE_S = 900


def device_memory_used_mib(device: str) -> int | None:
    """The driver's count for the whole device (every process's context and pool), or None on CPU."""
    return None if device == "cpu" else int(nvidia_smi("memory.used"))


def nvidia_smi(field: str) -> str:
    """One field of nvidia-smi's query for GPU 0 (`memory.used` in MiB, `driver_version`)."""
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "--id=0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip().splitlines()[0]


def reserved_mib(device: str) -> float:
    import torch

    return round(torch.cuda.memory_reserved() / 2**20, 1) if device != "cpu" else 0.0


def _reference_model(args):
    from rldock_benchmarks.gpu_checks import build_model

    return build_model(args.device, args.layers, vocab=args.vocab, seed=0).eval()


def _actor_loop(args, update, score_reference, host_logprobs) -> dict:
    """Warm-up, then `args.repeats` timed iterations: the reference's scores into host memory
    (`score_reference`), then back to the device and the update; each part timed."""
    from rldock_benchmarks.gpu_checks import synchronized, timed

    wait = synchronized(args.device)

    def update_step() -> None:
        update.step(old_logprobs=host_logprobs.to(args.device))

    score_reference()
    update_step()
    reference_s, update_s = [], []
    for _ in range(args.repeats):
        reference_s.append(timed(score_reference, wait))
        update_s.append(timed(update_step, wait))
    seconds = [r + u for r, u in zip(reference_s, update_s)]
    return {
        "seconds_per_iteration": round(statistics.median(seconds), 4),
        "reference_s": round(statistics.median(reference_s), 4),
        "update_s": round(statistics.median(update_s), 4),
        "seconds": [round(s, 4) for s in seconds],
    }


def _one_process(args, micro_batch_size: int, host_logprobs, results) -> None:
    from rldock_benchmarks.gpu_checks import PolicyUpdate

    update = PolicyUpdate(args.device, args.layers, micro_batch_size, vocab=args.vocab)
    reference = _reference_model(args)

    def score_reference() -> None:
        host_logprobs.copy_(update.logprobs(reference))

    timing = _actor_loop(args, update, score_reference, host_logprobs)
    results.put(
        timing
        | {
            "device_memory_used_mib": device_memory_used_mib(args.device),
            "allocator_reserved_mib": [reserved_mib(args.device)],
        }
    )


def _reference_process(args, micro_batch_size: int, host_logprobs, requests, results) -> None:
    from rldock_benchmarks.gpu_checks import batch_logprobs, smollm2_batch

    batch = smollm2_batch(args.device, args.vocab)
    reference = _reference_model(args)
    requests.send("ready")
    while requests.recv() == "score":
        host_logprobs.copy_(batch_logprobs(reference, batch, micro_batch_size=micro_batch_size))
        requests.send("scored")
    results.put({"reference_reserved_mib": reserved_mib(args.device)})


def _actor_process(args, micro_batch_size: int, host_logprobs, reference, results) -> None:
    from rldock_benchmarks.gpu_checks import PolicyUpdate

    update = PolicyUpdate(args.device, args.layers, micro_batch_size, vocab=args.vocab)
    _expect(reference, "ready")

    def score_reference() -> None:
        reference.send("score")
        _expect(reference, "scored")

    timing = _actor_loop(args, update, score_reference, host_logprobs)
    used = device_memory_used_mib(args.device)  # the reference process is alive, waiting
    reference.send("stop")
    results.put(timing | {"device_memory_used_mib": used, "actor_reserved_mib": reserved_mib(args.device)})


def _expect(connection, message: str) -> None:
    """The next message on `connection`, which must be `message` (EOFError if the other side died)."""
    received = connection.recv()
    if received != message:
        raise RuntimeError(f"expected {message!r} from the reference process, got {received!r}")


def _results(results, processes: list, count: int) -> list[dict]:
    """`count` results from `processes`, or a RuntimeError naming the one that exited without its
    result or the deadline passed (the processes are stopped then), never a wait without end."""
    from queue import Empty

    found: list[dict] = []
    deadline = time.monotonic() + LAYOUT_DEADLINE_S
    while len(found) < count:
        try:
            found.append(results.get(timeout=1))
            continue
        except Empty:
            pass
        failed = [process for process in processes if process.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            for process in processes:
                process.terminate()
            said = ", ".join(f"{p.name} exited with {p.exitcode}" for p in failed) or "deadline passed"
            raise RuntimeError(f"a layout's processes gave {len(found)} of {count} results: {said}")
    for process in processes:
        process.join()
    return found


def compare(args) -> dict:
    import torch
    import torch.multiprocessing as mp

    from rldock_benchmarks.gpu_checks import passes_config
    from rldock_benchmarks.update_cost import SHAPES

    micro_batch_size = passes_config(args).training.micro_batch_size
    shape = SHAPES["smollm2"]
    context = mp.get_context("spawn")
    idle_mib = device_memory_used_mib(args.device)

    host_logprobs = torch.zeros(shape.rows, shape.max_response_length).share_memory_()
    runs: dict[str, list[dict]] = {"one_process": [], "two_processes": []}
    exit_codes = []
    for _ in range(args.rounds):  # alternating, so a drift of the machine reaches both layouts
        results = context.Queue()
        one = context.Process(
            target=_one_process, args=(args, micro_batch_size, host_logprobs, results), name="one_process"
        )
        one.start()
        runs["one_process"] += _results(results, [one], 1)

        actor_end, reference_end = context.Pipe()
        reference = context.Process(
            target=_reference_process,
            args=(args, micro_batch_size, host_logprobs, reference_end, results),
            name="reference",
        )
        actor = context.Process(
            target=_actor_process, args=(args, micro_batch_size, host_logprobs, actor_end, results), name="actor"
        )
        reference.start()
        actor.start()
        actor_end.close()  # the children hold the ends now: one's death is the other's EOFError
        reference_end.close()
        first, second = _results(results, [reference, actor], 2)
        two = first | second
        two["allocator_reserved_mib"] = [two.pop("actor_reserved_mib"), two.pop("reference_reserved_mib")]
        runs["two_processes"].append(two)
        exit_codes += [one.exitcode, reference.exitcode, actor.exitcode]
    layouts = {name: _median_run(found) | {"runs": found} for name, found in runs.items()}
    for layout in layouts.values():
        used = layout["device_memory_used_mib"]
        if used is not None and idle_mib is not None:
            # what the driver counts beyond the allocators' pools: the processes' CUDA contexts
            layout["outside_allocators_mib"] = round(used - idle_mib - sum(layout["allocator_reserved_mib"]), 1)
    ratio = layouts["one_process"]["seconds_per_iteration"] / layouts["two_processes"]["seconds_per_iteration"]
    return {
        "idle_device_memory_used_mib": idle_mib,
        "layouts": layouts,
        "one_over_two_seconds": round(ratio, 3),
        "exit_codes": exit_codes,
        "ok": all(code == 0 for code in exit_codes),
    }


def _median_run(found: list[dict]) -> dict:
    """The run with the median seconds per iteration (the lower middle of an even count)."""
    ordered = sorted(found, key=lambda run: run["seconds_per_iteration"])
    median = ordered[(len(ordered) - 1) // 2]
    return {key: value for key, value in median.items() if key != "seconds"}
