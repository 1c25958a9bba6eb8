"""Linearity of the sample flow as nodes are added: the MindSpeed RL paper's Figure 9, in small.

A fixed number of prompts per node (G = k * --prompts-per-node on k nodes), nodes 1 -> 4 on the
emulated cluster (emulated_cluster.py), the GRPO sample flow of grpo_flow.py, for the central
buffer and the distributed dock. Throughput is samples per second of the whole flow (the
driver's put to the last update read); linearity at k nodes is the throughput per node relative
to one node (100% = perfect scaling). Prints one JSON document and saves a PNG plot beside
--output (a .json path).

--device-ms-per-sample models accelerator time (a sleep per sample in every stage, which costs
no CPU, so emulated devices work in parallel like real ones); 0 measures the dock alone.

    sudo .venv/bin/python -m rldock_benchmarks.linearity --output runs/bench/linearity.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from rldock_benchmarks import harness
from rldock_benchmarks.grpo_flow import PRESETS, Dims

VARIANTS = ("central", "distributed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="qwen25-7b", help="N, PL, SL and M from here")
    parser.add_argument("--prompts-per-node", type=int, default=8, help="G per node (fixed as nodes grow)")
    parser.add_argument("--nodes", default="1,2,3,4")
    parser.add_argument("--cap", default="300", help="link cap in MB/s, or `none`")
    parser.add_argument("--device-ms-per-sample", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--output", type=Path, default=Path("runs/bench/linearity.json"))
    parser.add_argument("--role", choices=("orchestrator", "driver"), default="orchestrator", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--node-ip", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def dims_for(args: argparse.Namespace, num_nodes: int) -> Dims:
    base = PRESETS[args.preset]
    return Dims(G=args.prompts_per_node * num_nodes, N=base.N, PL=base.PL, SL=base.SL, n=num_nodes, M=base.M)


def drive(args: argparse.Namespace) -> dict:
    from rldock.config.job import DockSpec
    from rldock.runtime.flow.catalogue import get_recipe
    from rldock.runtime.flow.columns import TOKEN_COLUMNS

    CONSUMES = get_recipe("grpo").consumes
    from rldock.runtime.dock import TransferDock

    counts = [int(k) for k in args.nodes.split(",")]
    node_ids, cluster = harness.connect(args.address, args.node_ip, max(counts))
    agents, _ = harness.start_agents(node_ids)
    points = []
    for num_nodes in counts:
        dims = dims_for(args, num_nodes)
        for variant in VARIANTS:
            dock = TransferDock.create(
                DockSpec(mode=variant, timeout_s=600),
                states={s: list(c) for s, c in CONSUMES.items()},
                num_samples=dims.num_samples,
                group_size=dims.N,
                token_columns=TOKEN_COLUMNS,
                node_ids=node_ids[:num_nodes],
            )
            try:
                records = harness.run_flow(
                    dock,
                    agents[:num_nodes],
                    dims,
                    repeats=args.repeats,
                    warmup=args.warmup,
                    device_s_per_sample=args.device_ms_per_sample / 1000,
                )
            finally:
                dock.shutdown()
            seconds = harness.median([r["seconds"] for r in records])
            cpu = records[len(records) // 2]["cpu_s"]
            points.append(
                {
                    "variant": variant,
                    "nodes": num_nodes,
                    "samples": dims.num_samples,
                    "seconds": [round(r["seconds"], 4) for r in records],
                    "seconds_median": round(seconds, 4),
                    "samples_per_s": round(dims.num_samples / seconds, 2),
                    "samples_per_s_per_node": round(dims.num_samples / seconds / num_nodes, 2),
                    "cpu_s": cpu,
                    "cpu_ms_per_sample": round(1000 * sum(cpu.values()) / dims.num_samples, 3),
                }
            )
            logging.getLogger(__name__).info("%s k=%d: %.3fs", variant, num_nodes, seconds)
    harness.disconnect(cluster)
    for point in points:
        one = next(p for p in points if p["variant"] == point["variant"] and p["nodes"] == 1)
        point["linearity"] = round(point["samples_per_s_per_node"] / one["samples_per_s_per_node"], 3)
        point["cpu_linearity"] = round(one["cpu_ms_per_sample"] / point["cpu_ms_per_sample"], 3)
    return {"points": points}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in report["runs"]:
        cap = run.get("applied_cap_MBps")
        for variant in VARIANTS:
            points = [p for p in run["points"] if p["variant"] == variant]
            label = f"{variant} ({'uncapped' if cap is None else f'{cap:g} MB/s'})"
            ax.plot([p["nodes"] for p in points], [100 * p["linearity"] for p in points], marker="o", label=label)
    nodes = sorted({p["nodes"] for run in report["runs"] for p in run["points"]})
    ax.plot(nodes, [100] * len(nodes), color="grey", linestyle=":", label="ideal")
    ax.axhline(80, color="tab:red", linestyle="--", linewidth=0.8, label="target 80%")
    ax.set_xlabel("emulated nodes (fixed prompts per node)")
    ax.set_ylabel("throughput per node vs 1 node (%)")
    ax.set_xticks(nodes)
    ax.set_ylim(0, 120)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"Linearity, {report['preset']}, {report['prompts_per_node']} prompts/node")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if args.role == "driver":
        print(json.dumps(drive(args)))
        return
    cap = None if args.cap.lower() == "none" else float(args.cap)
    driver_args = [
        "--preset",
        args.preset,
        "--prompts-per-node",
        str(args.prompts_per_node),
        "--nodes",
        args.nodes,
        "--device-ms-per-sample",
        str(args.device_ms_per_sample),
        "--repeats",
        str(args.repeats),
        "--warmup",
        str(args.warmup),
    ]
    counts = [int(k) for k in args.nodes.split(",")]
    report = harness.orchestrate(__spec__.name, driver_args, max_nodes=max(counts), caps=[cap])
    report = {
        "benchmark": "linearity",
        "preset": args.preset,
        "prompts_per_node": args.prompts_per_node,
        "device_ms_per_sample": args.device_ms_per_sample,
        "repeats": args.repeats,
        **report,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    png = args.output.with_suffix(".png")
    plot(report, png)
    report["plot"] = str(png)
    args.output.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
