"""Rules that span several fields of a JobConfig.

They are kept out of the pydantic validators so that a caller gets every problem at once, each
with the dotted path of the field to change: `rldock train` prints them, the operator turns them
into a condition and an Event on an RLJob that the API server's schema already accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rldock.config.job import JobConfig
from rldock.contract.algorithms import needs_critic
from rldock.contract.tensor_parallel import check_architecture, check_divisible


@dataclass(frozen=True)
class Problem:
    path: str  # dotted field path, e.g. "training.data_parallel_size"
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


def find_problems(cfg: JobConfig) -> list[Problem]:
    """Problems visible from the config alone (no filesystem, no cluster)."""
    problems: list[Problem] = []
    algo, training = cfg.algorithm, cfg.training
    num_samples = cfg.num_samples_per_iteration
    dp = training.data_parallel_size

    if num_samples % dp:
        problems.append(Problem(
            "training.data_parallel_size",
            f"G*N = {algo.num_prompts_per_iteration}*{algo.num_responses_per_prompt} = {num_samples} "
            f"samples per iteration cannot be split evenly over {dp} data-parallel ranks; choose a DP "
            f"size that divides {num_samples} or change algorithm.num_prompts_per_iteration",
        ))
    elif num_samples % (dp * algo.num_updates_per_iteration):
        problems.append(Problem(
            "algorithm.num_updates_per_iteration",
            f"each of the {dp} ranks holds {num_samples // dp} samples, which cannot be split into "
            f"{algo.num_updates_per_iteration} equal mini-batches",
        ))
    ranks = dp * training.tensor_parallel_size  # actor ranks, one device each
    if ranks > cfg.num_devices:
        what = f"{dp} ranks" if ranks == dp else f"data_parallel_size * tensor_parallel_size = {ranks} actor ranks"
        problems.append(Problem(
            "training.data_parallel_size" if ranks == dp else "training.tensor_parallel_size",
            f"{what} need {ranks} devices but resources give {cfg.resources.num_nodes} node(s) x "
            f"{cfg.resources.devices_per_node} = {cfg.num_devices}; lower the DP or TP size or add devices",
        ))
    # The critic (ppo, pf_ppo) asks for half a device like an actor or reference rank, which
    # already fill DP devices between them in pairs.
    if needs_critic(algo.name) and dp + 1 > cfg.num_devices >= dp:
        problems.append(Problem(
            "resources.devices_per_node",
            f"algorithm.name {algo.name} runs a critic worker besides the {dp} actor and reference "
            f"rank pairs, so it needs {dp + 1} devices but resources give {cfg.num_devices}; add a "
            "device or lower training.data_parallel_size",
        ))
    warehouses = cfg.dock.num_warehouses
    if warehouses is not None and warehouses > algo.num_prompts_per_iteration:
        problems.append(Problem(
            "dock.num_warehouses",
            f"{warehouses} warehouses for {algo.num_prompts_per_iteration} prompt groups would leave "
            "some warehouses empty; use at most one warehouse per prompt group",
        ))
    if cfg.checkpoint.interval > cfg.iterations:
        problems.append(Problem(
            "checkpoint.interval",
            f"interval {cfg.checkpoint.interval} exceeds iterations {cfg.iterations}; only the final "
            "checkpoint would be written, so a crash would lose the whole run",
        ))
    problems.extend(_dapo_problems(cfg))
    problems.extend(_dpo_problems(cfg))
    problems.extend(_resharding_problems(cfg))
    return problems


def _dapo_problems(cfg: JobConfig) -> list[Problem]:
    algo = cfg.algorithm
    if algo.name != "dapo" or algo.dapo.overlong_buffer_length <= algo.max_response_length:
        return []
    return [Problem(
        "algorithm.dapo.overlong_buffer_length",
        f"a buffer of {algo.dapo.overlong_buffer_length} tokens is longer than "
        f"algorithm.max_response_length {algo.max_response_length}; the penalty ramp must fit inside "
        "the response length, so lower it (0 turns the overlong penalty off)",
    )]


def _dpo_problems(cfg: JobConfig) -> list[Problem]:
    """DPO samples are chosen/rejected pairs (dock groups of 2) that no hand-out may split."""
    algo, training = cfg.algorithm, cfg.training
    if algo.name != "dpo":
        return []
    problems: list[Problem] = []
    if algo.num_responses_per_prompt != 2:
        problems.append(Problem(
            "algorithm.num_responses_per_prompt",
            f"dpo trains on (chosen, rejected) pairs, so it must be 2, not {algo.num_responses_per_prompt}",
        ))
        return problems
    dp, pairs = training.data_parallel_size, algo.num_prompts_per_iteration
    if pairs % dp == 0 and (pairs // dp) % algo.num_updates_per_iteration:
        problems.append(Problem(
            "algorithm.num_updates_per_iteration",
            f"each of the {dp} ranks holds {pairs // dp} pairs, which cannot be split into "
            f"{algo.num_updates_per_iteration} mini-batches of whole pairs",
        ))
    elif pairs % dp:
        problems.append(Problem(
            "algorithm.num_prompts_per_iteration",
            f"{pairs} preference pairs cannot be dealt evenly over {dp} data-parallel ranks without "
            f"splitting a pair; use a multiple of {dp}",
        ))
    if training.micro_batch_size % 2:
        problems.append(Problem(
            "training.micro_batch_size",
            f"{training.micro_batch_size} samples per micro-batch would split a chosen/rejected pair; "
            "use an even size",
        ))
    return problems


def _resharding_problems(cfg: JobConfig) -> list[Problem]:
    """Tensor parallelism and resharding: the actor's TP group trains on the same samples, while
    every actor rank is its own generation replica (TP 1) that takes whole prompt groups."""
    algo, training = cfg.algorithm, cfg.training
    tp, dp = training.tensor_parallel_size, training.data_parallel_size
    problems: list[Problem] = []
    if algo.name == "dpo" and (tp > 1 or training.resharding != "naive"):
        problems.append(Problem(
            "training.tensor_parallel_size" if tp > 1 else "training.resharding",
            "dpo has no rollout engine to reshard to and its preference update runs without tensor "
            "parallelism; use tensor_parallel_size 1 and resharding naive",
        ))
    elif tp > 1 and algo.num_prompts_per_iteration % (dp * tp):
        problems.append(Problem(
            "training.tensor_parallel_size",
            f"each of the {dp * tp} actor ranks generates whole prompt groups, so "
            f"algorithm.num_prompts_per_iteration {algo.num_prompts_per_iteration} must divide by "
            f"data_parallel_size * tensor_parallel_size = {dp * tp}",
        ))
    return problems


def _model_problems(cfg: JobConfig, model_dir: Path) -> list[Problem]:
    """Tensor parallelism needs a plan for the architecture and splits heads, KV heads and the MLP
    evenly (as the actor checks at start)."""
    tp = cfg.training.tensor_parallel_size
    config_file = model_dir / "config.json"
    if tp == 1 or not config_file.is_file():
        return []  # a tiny model still to be built has 4 heads, 2 KV heads, MLP 512: TP 2 splits it
    config = json.loads(config_file.read_text())
    try:
        check_architecture(tp_size=tp, model_type=config.get("model_type"), field="training.tensor_parallel_size")
        check_divisible(tp_size=tp, num_heads=config["num_attention_heads"],
                        num_kv_heads=config["num_key_value_heads"],
                        intermediate_size=config["intermediate_size"], field="training.tensor_parallel_size")
    except ValueError as error:
        return [Problem("training.tensor_parallel_size", str(error))]
    return []


def find_local_problems(cfg: JobConfig) -> list[Problem]:
    """Problems that need the local filesystem: run where the job will run, not in the operator."""
    model_dir = Path(cfg.model.path).expanduser()
    if cfg.model.builder is None and not (model_dir / "config.json").is_file():
        return [Problem(
            "model.path",
            f"no model at {model_dir} (config.json missing); point it at a Hugging Face format "
            "directory, or set model.builder to build a tiny demo model there",
        )]
    return _model_problems(cfg, model_dir)
