"""Rules that span several fields of a JobConfig: each section's own checks (SECTION_CHECKS, each beside its
fields in the section's module), gathered here, and below those that span sections: the batch over the
data-parallel ranks and the devices, the demo's defaults, extra workers, the old-logprob pass, routing
replay, async training, and what a model folder must hold (find_local_problems).

They are kept out of the pydantic validators so that a caller gets every problem at once, each
with the dotted path of the field to change: `rldock train` prints them, the operator turns them
into a condition and an Event on an RLJob that the API server's schema already accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rldock.config import (
    agent,
    algorithm,
    data,
    dock,
    evaluation,
    reward,
    rollout,
    rollout_correction,
    rollout_pool,
    training,
)
from rldock.config.job import JobConfig
from rldock.config.job_layout import job_layout
from rldock.config.problem import Problem
from rldock.contract.context_parallel import FIELD as CP_FIELD
from rldock.contract.context_parallel import check_heads_divide
from rldock.contract.tensor_parallel import TINY_MODEL_SHAPES, TP_PLANS, check_architecture, check_divisible

# Each section's checks, beside its fields in its own module (tests/unit/config/test_config_modules.py
# holds that none is left out).
SECTION_CHECKS = (
    agent.problems,
    algorithm.problems,
    data.problems,
    dock.problems,
    evaluation.problems,
    reward.problems,
    rollout.problems,
    rollout_correction.problems,
    rollout_pool.problems,
    training.problems,
)


def find_problems(cfg: JobConfig) -> list[Problem]:
    """Problems visible from the config alone (no filesystem, no cluster)."""
    problems: list[Problem] = []
    algo, training = cfg.algorithm, cfg.training
    num_samples = cfg.num_samples_per_iteration
    dp = training.data_parallel_size

    # a harness's episodes are agent.max_segments rows each (JobConfig.rows_per_episode)
    rows, rows_value = ("*agent.max_segments", f"*{cfg.rows_per_episode}") if cfg.rows_per_episode > 1 else ("", "")
    if num_samples % dp:
        problems.append(
            Problem(
                "training.data_parallel_size",
                f"G*N{rows} = {algo.num_prompts_per_iteration}*{algo.num_responses_per_prompt}{rows_value} = "
                f"{num_samples} samples per iteration cannot be split evenly over {dp} data-parallel ranks; choose a "
                f"DP size that divides {num_samples} or change algorithm.num_prompts_per_iteration",
            )
        )
    elif (num_samples // dp) % algo.num_updates_per_iteration:
        problems.append(
            Problem(
                "algorithm.num_updates_per_iteration",
                f"each of the {dp} ranks holds {num_samples // dp} samples{rows and ' (dock rows)'}, which cannot be "
                f"split into {algo.num_updates_per_iteration} equal mini-batches",
            )
        )
    layout = job_layout(cfg)
    ranks = layout.num_actor_ranks  # one device each
    if ranks > layout.num_devices:
        sizes = {"pipeline": layout.pp, "data": dp, "context": layout.cp, "tensor": layout.tp}
        named = [f"{kind}_parallel_size" for kind, size in sizes.items() if size > 1 or kind == "data"]
        what = f"{dp} ranks" if ranks == dp else f"{' x '.join(named)} = {ranks} actor ranks"
        # the largest dimension besides DP is the one to name, where there is one
        field = "training." + max(named, key=lambda name: (name != "data_parallel_size", sizes[name.split("_")[0]]))
        problems.append(
            Problem(
                field,
                f"{what} need {ranks} devices but resources give {layout.num_nodes} node(s) x "
                f"{layout.devices_per_node} = {layout.num_devices}; lower the DP, PP, CP or TP size or add devices",
            )
        )
    problems.extend(_extra_worker_problems(cfg))
    problems.extend(_demo_default_problems(cfg))
    problems.extend(_old_logprob_problems(cfg))
    problems.extend(_routing_replay_problems(cfg))
    problems.extend(_async_problems(cfg))
    for section_problems in SECTION_CHECKS:
        problems.extend(section_problems(cfg))
    return problems


def find_warnings(cfg: JobConfig) -> list[Problem]:
    """Settings that run but only hurt a long or interrupted run; `rldock validate` and `rldock
    train` print them with what to set, and the job starts anyway."""
    warnings: list[Problem] = []
    if cfg.checkpoint.interval > cfg.iterations:
        warnings.append(
            Problem(
                "checkpoint.interval",
                f"interval {cfg.checkpoint.interval} exceeds iterations {cfg.iterations}, so only the final "
                f"checkpoint is written and a crash loses the whole run; set checkpoint.interval <= {cfg.iterations}",
            )
        )
    return warnings


def _demo_default_problems(cfg: JobConfig) -> list[Problem]:
    """A left-out `data:` or `reward:` means the demo's addition prompts and digit_match, which fit
    only the tiny model the runtime builds; with a model of the user's they would train it on the
    wrong task without a word."""
    if cfg.model.builder is not None:
        return []
    problems = []
    if "data" not in cfg.model_fields_set:
        problems.append(
            Problem(
                "data",
                f"missing: without it model.path {cfg.model.path} would train on the tiny demo's addition prompts; "
                "set data.train_files (with data.prompt_key and data.answer_key naming your columns), or "
                "data.generator (docs/bring-your-own.md)",
            )
        )
    if "reward" not in cfg.model_fields_set:
        problems.append(
            Problem(
                "reward",
                "missing: without it responses are scored by the tiny demo's digit_match; set reward.terms, "
                "e.g. [{name: math_verify}] or [{name: function, function: my_reward.py:score}] (docs/rewards.md)",
            )
        )
    return problems


def _extra_worker_problems(cfg: JobConfig) -> list[Problem]:
    """Every device worker must have a seat in the placement plan (rldock.contract.placement): each
    actor rank a device of its own, reference ranks, the critic ranks (ppo, pf_ppo: one per DP rank)
    and the reward model (a `model` reward term) half a device each in colocated mode (filling the
    halves a TP job's actor devices have left before opening a device), a whole one in separate
    mode. The groups are the config's count (rldock.config.job_layout)."""
    layout = job_layout(cfg)
    if layout.num_actor_ranks > layout.num_devices:  # reported by find_problems already
        return []
    if layout.num_devices_needed <= layout.num_devices:
        return []
    extra = []
    critics = layout.group_ranks("critic")
    if critics:
        extra.append(f"algorithm.name {cfg.algorithm.name} runs {critics} critic rank(s) (one per data-parallel rank)")
    if layout.group_ranks("reward_model"):
        extra.append(f"reward.terms[{cfg.reward.model_term_index}] runs a reward-model worker")
    ranks = f"the {layout.num_actor_ranks} actor rank(s) and {layout.group_ranks('reference')} reference rank(s)"
    what = " and ".join(extra) + f" besides {ranks}" if extra else ranks
    return [
        Problem(
            "resources.devices_per_node",
            f"{what}: with {layout.placement} placement the job needs {layout.num_devices_needed} devices but "
            f"resources give {layout.num_devices}; add a device, lower training.data_parallel_size or use "
            "resources.placement colocated",
        )
    ]


def _old_logprob_problems(cfg: JobConfig) -> list[Problem]:
    """`never` takes the old logprobs from the update's own forward pass: exact only while the
    policy that sampled is the one that trains (one update, no stale samples)."""
    algo = cfg.algorithm
    if algo.recompute_old_logprobs != "never":
        return []
    problems: list[Problem] = []
    if algo.num_updates_per_iteration > 1:
        problems.append(
            Problem(
                "algorithm.recompute_old_logprobs",
                f"`never` with algorithm.num_updates_per_iteration {algo.num_updates_per_iteration}: after the "
                "first optimizer step the policy is no longer the one that sampled, so the ratio would be wrong; "
                "use `auto` (or `always`), or set num_updates_per_iteration to 1",
            )
        )
    if cfg.dock.max_staleness > 0:
        problems.append(
            Problem(
                "algorithm.recompute_old_logprobs",
                f"`never` with dock.max_staleness {cfg.dock.max_staleness}: samples from older policies would "
                "train with a ratio of 1; use `auto` (or `always`), or set dock.max_staleness to 0",
            )
        )
    return problems


def _routing_replay_problems(cfg: JobConfig) -> list[Problem]:
    """Routing replay (runtime models/routing_replay.py): `reference` records the routing in the
    actor's old-logprob pass, so it needs that pass and a recipe with one (not DPO's); under context
    parallelism each CP rank records and replays its own tokens' cells of the grid. `rollout` needs
    the engine's routed experts, which the rollout does not collect."""
    algo, field = cfg.algorithm, "algorithm.routing_replay"
    if algo.routing_replay == "off":
        return []
    if algo.routing_replay == "rollout":
        return [
            Problem(
                field,
                "`rollout` needs the inference engine's routed experts per token: vLLM 0.32 returns them only under "
                "its Model Runner V2 (Triton, a GPU; enable_return_routed_experts) and rldock's rollout does not "
                "collect them yet; use `reference` (the old-logprob pass's routing)",
            )
        ]
    problems = []
    if algo.name == "dpo":
        problems.append(Problem(field, "`reference` replays the old-logprob pass's routing; DPO has none: use off"))
    if algo.recompute_old_logprobs == "never":
        problems.append(
            Problem(
                field,
                "`reference` records the routing in the old-logprob pass, which recompute_old_logprobs `never` "
                "leaves out; set algorithm.recompute_old_logprobs to auto (the pass then runs) or routing_replay off",
            )
        )
    return problems


def _async_problems(cfg: JobConfig) -> list[Problem]:
    """The asynchronous pipeline runs the next iteration's generation and inference passes on the
    actor ranks between this iteration's old-logprob pass and its update: it needs a rollout, one
    fixed batch per iteration and a schedule that lets an iteration's phases interleave with the next's.
    Any training layout runs it: every actor rank runs its calls in the order they were queued, so the
    collectives of a sharded or split layout line up, and the training state comes back before an
    update wherever the last export left it."""
    algo, training = cfg.algorithm, cfg.training
    if training.mode != "async":
        return []
    problems: list[Problem] = []
    if algo.name in ("dpo", "dapo"):
        why = (
            "has no rollout to run ahead"
            if algo.name == "dpo"
            else "refills its batch in sampling rounds that read the reward before the next round"
        )
        problems.append(
            Problem(
                "training.mode",
                f"`async` with algorithm.name {algo.name}, which {why}; use training.mode sync",
            )
        )
    if cfg.resources.phase_schedule == "serial":
        problems.append(
            Problem(
                "resources.phase_schedule",
                "`serial` with training.mode async: the serial schedule orders one iteration's phases on each "
                "device, while the async pipeline runs the next iteration's generation before this one's update; "
                "use phase_schedule auto or overlap, or training.mode sync",
            )
        )
    # `never` with a staleness bound above 0 (the pipeline running ahead) is _old_logprob_problems'.
    return problems


def _expert_problems(cfg: JobConfig, config_file: Path) -> list[Problem]:
    """EP and routing replay need an MoE model, whose experts EP divides (read from config.json; a model
    still to be built by model.builder is checked when the actor builds it)."""
    ep, field = cfg.training.expert_parallel_size, "training.expert_parallel_size"
    if not config_file.is_file():
        return []
    config = json.loads(config_file.read_text())
    num_experts = config.get("num_experts", config.get("num_local_experts", config.get("n_routed_experts")))
    replay = cfg.algorithm.routing_replay
    if replay != "off" and not num_experts:
        return [Problem("algorithm.routing_replay", f"{replay} needs an MoE model; {config_file} has none: set it off")]
    if ep == 1:
        return []
    if not num_experts:
        return [
            Problem(field, f"{ep} needs an MoE model; {config_file} has no num_experts: use expert_parallel_size 1")
        ]
    if num_experts % ep:
        return [Problem(field, f"{ep} must divide the model's {num_experts} experts; use a divisor of {num_experts}")]
    return []


def _model_problems(cfg: JobConfig, model_dir: Path) -> list[Problem]:
    """Training tensor parallelism needs a plan for the architecture and splits heads, KV heads and
    the MLP evenly (as the actor checks at start); generation TP needs the even split; Ulysses context
    parallelism splits a TP rank's heads and KV heads evenly."""
    tp, gen_tp = cfg.training.tensor_parallel_size, cfg.rollout.tensor_parallel_size
    cp = cfg.training.context_parallel_size
    config_file = model_dir / "config.json"
    problems = _expert_problems(cfg, config_file)
    if tp == 1 and gen_tp == 1 and cp == 1:
        return problems
    # a tiny model still to be built has the tiny builders' shapes
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else dict(TINY_MODEL_SHAPES)
    if not config_file.is_file() and cfg.model.builder is None:
        return problems  # reported as a missing model
    try:
        check_heads_divide(
            cp=cp,
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            mode=cfg.training.context_parallel_mode,
            tp=tp,
        )
    except ValueError as error:
        problems.append(Problem(CP_FIELD, str(error)))
    if tp == 1 and gen_tp == 1:
        return problems
    try:
        check_architecture(tp_size=tp, model_type=config.get("model_type"), field="training.tensor_parallel_size")
        plan = TP_PLANS.get(config.get("model_type") or "")
        check_divisible(
            tp_size=tp,
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            intermediate_size=config.get("intermediate_size") if plan is None or plan.splits_mlp else None,
            field="training.tensor_parallel_size",
        )
        if tp > 1 and plan is not None and not plan.splits_mlp and cfg.training.strategy != "fsdp":
            raise ValueError(
                f"training.tensor_parallel_size={tp} on a mixture-of-experts model ({config.get('model_type')}) runs "
                "under strategy fsdp only: its experts are expert parallelism's, beside TP's split of the attention, "
                "and the TP layout (strategy ddp) has not run with them; set training.strategy: fsdp"
            )
    except ValueError as error:
        problems.append(Problem("training.tensor_parallel_size", str(error)))
    try:  # vLLM splits heads and the MLP with its own plans: only even shapes are ours to check
        check_divisible(
            tp_size=gen_tp,
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            intermediate_size=config["intermediate_size"],
            field="rollout.tensor_parallel_size",
        )
    except ValueError as error:
        problems.append(Problem("rollout.tensor_parallel_size", str(error)))
    return problems


def find_local_problems(cfg: JobConfig) -> list[Problem]:
    """Problems that need the local filesystem: run where the job will run (`rldock validate`,
    `rldock train`), not in the operator or the planner."""
    model_dir = Path(cfg.model.path)
    config_file = model_dir / "config.json"
    if cfg.model.builder is None and not config_file.is_file():
        return [
            Problem(
                "model.path",
                f"no model at {model_dir} (config.json missing); point it at a Hugging Face format "
                "directory, or set model.builder to build a tiny demo model there",
            )
        ]
    problem = model_config_problem(config_file) if config_file.is_file() else None
    if problem is not None:
        return [Problem("model.path", problem)]
    return _model_problems(cfg, model_dir)


def model_config_problem(config_file: Path) -> str | None:
    """What keeps a model folder's config.json from being read as a Hugging Face config, or None."""
    try:
        config = json.loads(config_file.read_bytes())
    except OSError as error:
        return f"{config_file} cannot be read: {error.strerror}"
    except ValueError as error:  # not JSON, or not UTF-8 (JSONDecodeError and UnicodeDecodeError)
        return f"{config_file} is not valid JSON ({error}); point the field at a folder save_pretrained wrote"
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return (
            f"{config_file} names no model_type, so it is no Hugging Face model config; point the field at "
            "a folder save_pretrained wrote"
        )
    return None
