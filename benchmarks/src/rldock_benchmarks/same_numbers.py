"""Whether two runs of a job computed the same numbers: the learning metrics of every iteration
(reward, KL, loss, entropy) equal, and every checkpoint file byte-identical. A refactor that must
not change what the job computes is checked by running the demo before and after it:

    python -m rldock_benchmarks.same_numbers BEFORE_OUTPUT AFTER_OUTPUT [--control CONTROL_OUTPUT]

`--control`: a second run before the change. A file that differs between the two runs before it
is not reproducible to begin with and is listed apart (`not_reproducible_before`) instead of counting
against the change. Two runs of the demo from one commit write byte-identical checkpoint files, rng.pt
included (tests/integration/test_reproducible_checkpoints.py), so there the list stays empty.

Prints one JSON object (`same`: both hold; the iterations compared, the metrics that differ with
their first differing iteration, the checkpoint files compared and those that differ or exist in
one run only) and exits 1 when the numbers differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

METRICS = ("reward_mean", "kl", "loss", "entropy")


def _records(output: Path) -> dict[int, dict]:
    lines = (output / "metrics.jsonl").read_text().splitlines()
    return {record["iteration"]: record for record in map(json.loads, filter(str.strip, lines))}


def _checksums(output: Path) -> dict[str, str]:
    root = output / "checkpoints"
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def compare(before: Path, after: Path, metrics: tuple[str, ...] = METRICS, control: Path | None = None) -> dict:
    old, new = _records(before), _records(after)
    iterations = sorted(set(old) & set(new))
    differing = {}
    for name in metrics:
        first = next((i for i in iterations if old[i].get(name) != new[i].get(name)), None)
        if first is not None:
            differing[name] = {"iteration": first, "before": old[first].get(name), "after": new[first].get(name)}
    old_sums, new_sums = _checksums(before), _checksums(after)
    files = sorted(set(old_sums) | set(new_sums))
    unstable = (
        [] if control is None else sorted(f for f, digest in _checksums(control).items() if old_sums.get(f) != digest)
    )
    changed = [f for f in files if old_sums.get(f) != new_sums.get(f) and f not in unstable]
    same = not differing and not changed and set(old) == set(new) and bool(iterations)
    return {
        "same": same,
        "iterations": len(iterations),
        "iterations_in_one_run_only": sorted(set(old) ^ set(new)),
        "metrics": list(metrics),
        "metrics_differing": differing,
        "checkpoint_files": len(files),
        "checkpoint_files_differing": changed,
        "not_reproducible_before": unstable,
        "sha256": new_sums,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="the --output of the run before the change")
    parser.add_argument("after", type=Path, help="the --output of the run after it")
    parser.add_argument("--control", type=Path, help="the --output of a second run before the change")
    args = parser.parse_args(argv)
    result = compare(args.before, args.after, control=args.control)
    print(json.dumps(result, indent=2))
    return 0 if result["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
