"""The GRPO sample flow of one iteration, without models: every dock read and write a real job makes.

One `NodeAgent` actor per emulated node runs that node's rank of every worker state at once, in
threads, through the runtime's own stage loop (`runtime/src/rldock/runtime/dock/stage_loop.py`) and dataflow
(`runtime/src/rldock/runtime/flow/columns.py`): rollout (whole groups in, responses out), actor inference and reference
(old and reference logprobs), reward, advantage (whole groups), and the update (a token-balanced
share per rank, read only). "Compute" just fills the output columns, so the time measured is the
dock's: requests, reads and writes. The driver puts the prompts, as the trainer does.

Dimensions are the paper's (G prompts, N responses each, prompt length PL, response length SL,
n devices, M samples per dock request); `predicted_bytes` gives the traffic the dock should
count for them, per warehouse, from the column sizes alone.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import run_stage
from rldock.runtime.flow.catalogue import get_recipe
from rldock.runtime.flow.columns import TOKEN_COLUMNS
from rldock.runtime.flow.states import WorkerState

# Per-sample bytes of each dock column for prompt length PL and response length SL (the schema
# of docs/architecture.md: int64 token ids and masks, float32 logprobs and scalars; each sample's
# prompt_index is one int64, and so is its prompt_draw; its train row, which the reward reads, is ROW_BYTES).
_INT64, _FLOAT32 = 8, 4
# A train row as the dock carries it (`prompt_row`, data/row_column.py): a short prompt's row pickled, its
# answer, data source and extra info, about this wide (the demo's are 220-260 bytes).
ROW_BYTES = 256
# GRPO's flow, the one these benchmarks move
CONSUMES, PRODUCES = get_recipe("grpo").consumes, get_recipe("grpo").produces


def column_bytes(pl: int, sl: int) -> dict[str, int]:
    return {
        "prompt_ids": pl * _INT64,
        "prompt_mask": pl * _INT64,
        "prompt_index": _INT64,
        "prompt_row": ROW_BYTES,
        "prompt_draw": _INT64,  # the group's draw number, which the driver puts and reads back (the prompt ledger)
        "response_ids": sl * _INT64,
        "response_mask": sl * _INT64,
        "response_length": _INT64,  # the rollout writes each response's length (one int64), the driver reads it
        "policy_version": _INT64,  # the rollout tags each sample with the weights' version (one int64)
        "old_logprobs": sl * _FLOAT32,
        "ref_logprobs": sl * _FLOAT32,
        "reward": _FLOAT32,
        "score": _FLOAT32,  # the reward before shaping, which the driver reads (sample_facts)
        "advantage": _FLOAT32,
    }


@dataclass(frozen=True)
class Dims:
    """One GRPO iteration's shape: G prompts x N responses, lengths PL and SL; n devices; M per request."""

    G: int
    N: int
    PL: int
    SL: int
    n: int
    M: int

    @property
    def num_samples(self) -> int:
        return self.G * self.N

    def scaled(self, factor: float, *, multiple_of: int) -> Dims:
        """G divided by `factor` (rounded to a multiple of `multiple_of`, at least that); the rest kept."""
        groups = max(multiple_of, int(round(self.G / factor / multiple_of)) * multiple_of)
        return Dims(G=groups, N=self.N, PL=self.PL, SL=self.SL, n=self.n, M=self.M)


# The paper's Table 1 (arXiv 2507.19017) could not be retrieved where this was written; these
# presets take G, N, PL, SL and n from MindSpeed RL's published GRPO configs for the same models
# (configs/grpo_qwen25_7b_A3.yaml, grpo_qwen25_32b_A3.yaml, grpo_deepseek_r1_671b_A3.yaml in
# Ascend/MindSpeed-RL). M, the samples per dock request, is ours: 64.
PRESETS: dict[str, Dims] = {
    "qwen25-7b": Dims(G=32, N=8, PL=2048, SL=2048, n=16, M=64),
    "qwen25-32b": Dims(G=64, N=16, PL=1024, SL=2048, n=16, M=64),
    "deepseek-r1-671b": Dims(G=384, N=32, PL=1024, SL=2048, n=384, M=64),
}


def bytes_per_sample(dims: Dims) -> dict[str, float]:
    """Bytes one sample makes the dock move in one iteration: each column written once, and each
    state's consumed columns read once. The driver's columns (the prompt, its row) are written
    once per group of N (`driver_written`, per sample: the group's bytes / N); `written` and
    `total` count them so. `written_repeated` is the same with the prompt sent for every sample,
    as the dock did before and TransferQueue still does."""
    sizes = column_bytes(dims.PL, dims.SL)
    driver = sum(sizes[c] for c in PRODUCES["driver"])
    others = sum(sizes[c] for state, cols in PRODUCES.items() if state != "driver" for c in cols)
    read = sum(sizes[c] for cols in CONSUMES.values() for c in cols)
    return {
        "driver_written": driver / dims.N,
        "written": others + driver / dims.N,
        "read": read,
        "total": others + driver / dims.N + read,
        "written_repeated": others + driver,
    }


def predicted_bytes(dims: Dims, samples_per_warehouse: list[int], *, prompt_once: bool = True) -> list[int]:
    """Eq. (2)/(4) as used here: a store moves bytes_per_sample x the samples it owns.

    With one central buffer that is every sample: V = G*N*b (Eq. 2). With S warehouses owning
    whole groups, warehouse w moves V * G_w / G, i.e. V / S when S divides G (Eq. 4). With
    `prompt_once` (the dock) b counts the driver's columns once per group, i.e. b_driver / N per
    sample; without (TransferQueue) N times.
    """
    per_sample = bytes_per_sample(dims)
    total = per_sample["total"] if prompt_once else per_sample["read"] + per_sample["written_repeated"]
    return [int(round(count * total)) for count in samples_per_warehouse]


def make_prompts(dims: Dims, seed: int = 0) -> TensorDict:
    """The driver's batch: G prompts, each repeated N times, with their train-file rows, as the
    trainer builds it (the dock sends each group's rows once, see split_group_columns). Prompt
    lengths are skewed (log-normal), left-padded."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(math.log(dims.PL / 4), 0.6, dims.G), 1, dims.PL).astype(np.int64)
    lengths = torch.from_numpy(np.repeat(lengths, dims.N))  # (G*N,)
    positions = torch.arange(dims.PL)
    prompt_mask = (positions >= dims.PL - lengths[:, None]).long()  # (G*N, PL), left padding
    prompt_ids = prompt_mask * (torch.arange(dims.G).repeat_interleave(dims.N)[:, None] % 1000 + 3)
    prompt_index = torch.arange(dims.G).repeat_interleave(dims.N)  # (G*N,)
    prompt_row = (prompt_index[:, None] + torch.arange(ROW_BYTES)).to(torch.uint8)  # (G*N, ROW_BYTES), per group
    return TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "prompt_index": prompt_index,
            "prompt_row": prompt_row,
            "prompt_draw": prompt_index,
        },
        batch_size=[dims.num_samples],
    )


def response_lengths(indices: torch.Tensor, sl: int) -> torch.Tensor:
    """A skewed, repeatable response length per sample index (B,): log-normal around SL/8, capped."""
    rng = np.random.default_rng(indices.numpy() * 7919 % 2**31)
    lengths = np.clip(rng.lognormal(math.log(sl / 8), 1.0, len(indices)), 1, sl)
    return torch.from_numpy(lengths.astype(np.int64))


class NodeAgent:
    """One emulated node's ranks of every worker state (a threaded Ray actor)."""

    def __init__(self, node: int) -> None:
        self.node = node
        self._gcs_pid: int | None = None

    def address(self) -> str:
        """This node's IP address (inside its namespace)."""
        import ray

        return ray.util.get_node_ip_address()

    def link_counters(self) -> dict[str, int] | None:
        """Bytes through this node's emulated NIC so far (None without an emulated network)."""
        stats = Path("/sys/class/net/eth0/statistics")
        if not stats.is_dir():
            return None
        return {"rx_bytes": int((stats / "rx_bytes").read_text()), "tx_bytes": int((stats / "tx_bytes").read_text())}

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of this agent, of its node's raylet (the agent's parent) and, on the
        head node, of the GCS (a sibling of the raylet under the same `ray start`)."""
        raylet = os.getppid()
        if self._gcs_pid is None:  # looked up once: scanning /proc costs more CPU than an iteration's calls
            starter = _proc_stat(raylet)[1]
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    stat = _proc_stat(int(entry.name))
                    if stat and stat[1] == starter and "gcs" in stat[0]:
                        self._gcs_pid = int(entry.name)
            self._gcs_pid = self._gcs_pid or 0
        out = {"raylet": _proc_cpu(raylet)}
        if self._gcs_pid:
            out["gcs"] = _proc_cpu(self._gcs_pid)
        out["agent"] = time.process_time()  # last, so this call's own work falls outside the interval
        return out

    def receive(self, port: int, nbytes: int) -> float:
        """Accept one TCP connection and read `nbytes`; seconds from the first to the last byte."""
        import socket

        with socket.create_server(("0.0.0.0", port)) as server:
            server.settimeout(120)
            conn, _ = server.accept()
            with conn:
                buffer = bytearray(4 * 1024 * 1024)
                got = conn.recv_into(buffer)
                started = time.perf_counter()
                while got < nbytes:
                    n = conn.recv_into(buffer)
                    if n == 0:
                        break
                    got += n
                return time.perf_counter() - started

    def send(self, host: str, port: int, nbytes: int) -> None:
        import socket

        payload = bytes(4 * 1024 * 1024)
        for _ in range(100):  # the receiver may not listen yet
            try:
                conn = socket.create_connection((host, port), timeout=10)
                break
            except OSError:
                time.sleep(0.1)
        with conn:
            sent = 0
            while sent < nbytes:
                conn.sendall(payload[: min(len(payload), nbytes - sent)])
                sent += min(len(payload), nbytes - sent)

    def run_state(
        self, dock: TransferDock, state: str, rank: int, num_ranks: int, dims: dict, device_s_per_sample: float = 0.0
    ) -> dict[str, Any]:
        """This node's rank of `state` for one iteration, through the runtime's stage loop.

        Every rank takes exactly its 1/num_ranks share of the samples, as data-parallel ranks of
        equal speed do when compute, not the dock, is the bottleneck. (Without compute, a rank on
        the data's node would otherwise take nearly everything and hide the network.)
        `device_s_per_sample` models accelerator time: the stage sleeps that long per sample
        (sleeping takes no CPU, so emulated devices run in parallel as real ones do).
        """
        d = Dims(**dims)
        columns = CONSUMES[state]
        share = d.num_samples // num_ranks
        whole = state in ("rollout", "advantage")
        batch = _batch_size(share, d.M, d.N if whole else 1)
        fns = {
            "rollout": lambda i, b: _responses(i, d.SL),
            "actor_inference": lambda i, b: _logprobs(b, "old_logprobs"),
            "reference": lambda i, b: _logprobs(b, "ref_logprobs"),
            "reward": lambda i, b: _rewards(b),
            "advantage": lambda i, b: _advantages(b, d.N),
            "sample_facts": lambda i, b: None,  # the driver's read: it writes nothing back
        }
        if state in fns:
            fn = fns[state]

            def compute(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
                time.sleep(device_s_per_sample * len(indices))
                return fn(indices, batch)

            timing = run_stage(
                dock,
                WorkerState(state, None, "", consumes=columns),
                compute,
                rank=rank,
                batch_size=batch,
                whole_groups=whole,
                max_batches=share // batch,
            )
        elif state == "update":
            tokens: list[int] = []

            def update(indices: torch.Tensor, batch: TensorDict) -> None:
                time.sleep(device_s_per_sample * len(indices))
                tokens.append(int(sum(batch[c].sum() for c in TOKEN_COLUMNS)))

            timing = run_stage(
                dock,
                WorkerState(state, None, "", consumes=columns),
                update,
                rank=rank,
                batch_size=d.num_samples // num_ranks,
                balance_ranks=num_ranks,
                max_batches=1,
            )
            timing.metrics["tokens"] = sum(tokens)
        else:
            raise ValueError(f"unknown state {state!r}")
        return {"state": state, "rank": rank, **asdict(timing), **timing.metrics}


def _proc_stat(pid: int) -> tuple[str, int, float] | None:
    """(command name, parent pid, CPU seconds) of `pid` from /proc, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _proc_cpu(pid: int) -> float:
    stat = _proc_stat(pid)
    return stat[2] if stat else 0.0


def _batch_size(share: int, most: int, unit: int) -> int:
    """The largest multiple of `unit` that divides `share` and is at most `most` (at least `unit`)."""
    best = unit
    for size in range(unit, min(share, max(most, unit)) + 1, unit):
        if share % size == 0:
            best = size
    return best


def _responses(indices: torch.Tensor, sl: int) -> TensorDict:
    mask = (torch.arange(sl) < response_lengths(indices, sl)[:, None]).long()  # (B, SL)
    versions = torch.zeros(len(indices), dtype=torch.int64)  # (B,) the rollout's policy_version column
    return TensorDict(
        {
            "response_ids": mask * 7,
            "response_mask": mask,
            "response_length": mask.sum(dim=1),
            "policy_version": versions,
        },
        batch_size=[len(indices)],
    )


def _logprobs(batch: TensorDict, name: str) -> TensorDict:
    return TensorDict({name: batch["response_mask"].float() * -0.5}, batch_size=batch.batch_size)  # (B, SL)


def _rewards(batch: TensorDict) -> TensorDict:
    reward = (batch["response_mask"].sum(dim=1) % 3).float() / 2  # (B,)
    return TensorDict({"reward": reward, "score": reward}, batch_size=batch.batch_size)


def _advantages(batch: TensorDict, group: int) -> TensorDict:
    rewards = batch["reward"].view(-1, group)  # (B/N, N)
    advantages = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-6)
    return TensorDict({"advantage": advantages.reshape(-1)}, batch_size=batch.batch_size)


def dims_dict(dims: Dims) -> dict[str, int]:
    return asdict(dims)
