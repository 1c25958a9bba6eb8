"""Rules that span several fields of a JobConfig: the sections' own checks (SECTION_CHECKS, each beside its
fields in the section's module) and, below, those of the sections still in job.py.

They are kept out of the pydantic validators so that a caller gets every problem at once, each
with the dotted path of the field to change: `rldock train` prints them, the operator turns them
into a condition and an Event on an RLJob that the API server's schema already accepted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rldock.config import agent, algorithm, dock, evaluation, reward, rollout_correction
from rldock.config.job import JobConfig
from rldock.config.job_layout import job_layout
from rldock.config.problem import Problem
from rldock.contract.algorithms import (
    needs_rollout,
)
from rldock.contract.context_parallel import FIELD as CP_FIELD
from rldock.contract.context_parallel import check_heads_divide
from rldock.contract.tensor_parallel import TINY_MODEL_SHAPES, check_architecture, check_divisible

# The checks of the sections that keep them beside their fields (one module per section, issue 65); the
# others are below, until each moves to its section's module.
SECTION_CHECKS = (
    agent.problems,
    algorithm.problems,
    dock.problems,
    evaluation.problems,
    reward.problems,
    rollout_correction.problems,
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
        what = (
            f"{dp} ranks"
            if ranks == dp
            else f"data_parallel_size x context_parallel_size x tensor_parallel_size = {ranks} actor ranks"
        )
        field = "training.data_parallel_size"
        if ranks != dp:
            field = "training.tensor_parallel_size" if layout.tp > 1 else "training.context_parallel_size"
        problems.append(
            Problem(
                field,
                f"{what} need {ranks} devices but resources give {layout.num_nodes} node(s) x "
                f"{layout.devices_per_node} = {layout.num_devices}; lower the DP, CP or TP size or add devices",
            )
        )
    problems.extend(_extra_worker_problems(cfg))
    problems.extend(_demo_default_problems(cfg))
    problems.extend(_data_problems(cfg))
    problems.extend(_resharding_problems(cfg))
    problems.extend(_generation_tp_problems(cfg))
    problems.extend(_strategy_problems(cfg))
    problems.extend(_context_parallel_problems(cfg))
    problems.extend(_micro_batch_problems(cfg))
    problems.extend(_old_logprob_problems(cfg))
    problems.extend(_routing_replay_problems(cfg))
    problems.extend(_return_logprobs_problems(cfg))
    problems.extend(_async_problems(cfg))
    problems.extend(_partial_rollout_problems(cfg))
    problems.extend(_demonstration_problems(cfg))
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


def _return_logprobs_problems(cfg: JobConfig) -> list[Problem]:
    """rollout.return_logprobs is the plain rollout's: the other modes write columns of their own."""
    rollout = cfg.rollout
    if not rollout.return_logprobs:
        return []
    others = {
        "agent": cfg.agent is not None,
        "rollout.partial_rollout": rollout.partial_rollout != "off",
        "rollout.stream_groups": rollout.stream_groups > 0,
        "DPO": cfg.algorithm.name == "dpo",
    }
    return [
        Problem("rollout.return_logprobs", f"is the plain rollout's, not with {other}: set it false")
        for other, present in others.items()
        if present
    ]


def _async_problems(cfg: JobConfig) -> list[Problem]:
    """The asynchronous pipeline runs the next iteration's generation and inference passes on the
    actor ranks between this iteration's old-logprob pass and its update: it needs a rollout, one
    fixed batch per iteration and a training state that stays resident during generation."""
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
    if training.tensor_parallel_size > 1 or training.resharding != "naive":
        problems.append(
            Problem(
                "training.mode",
                "`async` needs training.tensor_parallel_size 1 and training.resharding naive: the next "
                "iteration generates while this one's training state is resident; use training.mode sync",
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


def _partial_rollout_problems(cfg: JobConfig) -> list[Problem]:
    """Partial rollout cuts the generation that runs ahead of a weight update: it needs the async
    pipeline running ahead (and so a rollout), and a round budget that can cut a response."""
    rollout, training, algo = cfg.rollout, cfg.training, cfg.algorithm
    problems: list[Problem] = []
    default_cap = type(rollout).model_fields["importance_cap"].default
    if rollout.importance_cap != default_cap and rollout.importance_correction != "decoupled":
        # A cap nothing reads would look like a bound that holds. (Compared with the default, not by
        # whether it was set: the operator's resolved config writes every field.)
        problems.append(
            Problem(
                "rollout.importance_cap",
                "read only with rollout.importance_correction decoupled (the truncated importance weight); "
                f"here {rollout.importance_correction or 'unset'}: remove it or set decoupled",
            )
        )
    if rollout.partial_rollout == "off":
        if rollout.importance_correction is not None:
            problems.append(
                Problem(
                    "rollout.importance_correction",
                    f"`{rollout.importance_correction}` is read only with rollout.partial_rollout resume or drop "
                    "(here off); remove it",
                )
            )
        return problems
    if rollout.partial_rollout == "carry":
        return problems + _carry_problems(cfg) + _importance_problems(cfg)
    if training.mode != "async" or cfg.dock.max_staleness < 1:
        problems.append(
            Problem(
                "rollout.partial_rollout",
                f"`{rollout.partial_rollout}` cuts generations at a weight update, which only happen while a "
                f"generation runs ahead (training.mode async with dock.max_staleness >= 1; here mode "
                f"{training.mode}, max_staleness {cfg.dock.max_staleness}); set those or use `off`",
            )
        )
    if not needs_rollout(algo.name):
        problems.append(
            Problem(
                "rollout.partial_rollout",
                f"`{rollout.partial_rollout}` with algorithm.name {algo.name}, which generates nothing; use `off`",
            )
        )
    if rollout.max_tokens_per_round is None:
        problems.append(
            Problem(
                "rollout.max_tokens_per_round",
                f"required with rollout.partial_rollout {rollout.partial_rollout}: it decides where a generation "
                f"is cut; set it below algorithm.max_response_length ({algo.max_response_length})",
            )
        )
    elif rollout.max_tokens_per_round >= algo.max_response_length:
        problems.append(
            Problem(
                "rollout.max_tokens_per_round",
                f"{rollout.max_tokens_per_round} is not below algorithm.max_response_length "
                f"({algo.max_response_length}), so no response would ever be cut; lower it or use "
                "rollout.partial_rollout off",
            )
        )
    problems.extend(_importance_problems(cfg))
    return problems


def _carry_problems(cfg: JobConfig) -> list[Problem]:
    """Carried episodes (rollout/carry.py) keep an agent's episode groups open across iterations, within
    dock.max_staleness versions of the iteration that started them: the native loop's episodes, one fixed
    batch per iteration, and the bound counted from the synchronous iteration (with agent, its harness
    and DPO refused by rldock.config.agent's checks)."""
    rollout, training, algo = cfg.rollout, cfg.training, cfg.algorithm
    problems: list[Problem] = []
    if cfg.agent is None:
        problems.append(
            Problem(
                "rollout.partial_rollout",
                "`carry` carries an agent's episodes across iterations and needs an agent section (the native "
                "loop); single-turn responses are cut by tokens instead: use resume or drop with training.mode async",
            )
        )
    if training.mode != "sync":
        problems.append(
            Problem(
                "training.mode",
                f"`{training.mode}` with rollout.partial_rollout carry: a carried group already trains up to "
                "dock.max_staleness versions after the iteration that started it, and the pipeline running ahead "
                "would add one to each; use training.mode sync",
            )
        )
    if cfg.dock.max_staleness < 1:
        problems.append(
            Problem(
                "dock.max_staleness",
                f"{cfg.dock.max_staleness} with rollout.partial_rollout carry: it is the versions a carried group "
                "may train after the iteration that started it, so at least 1 (0 is the synchronous iteration: "
                "use rollout.partial_rollout off)",
            )
        )
    if rollout.max_tokens_per_round is not None:
        problems.append(
            Problem(
                "rollout.max_tokens_per_round",
                f"{rollout.max_tokens_per_round} with rollout.partial_rollout carry, which cuts an iteration by the "
                "groups that finished, not by tokens; remove it",
            )
        )
    if algo.name == "dapo":
        problems.append(
            Problem(
                "rollout.partial_rollout",
                "`carry` with algorithm.name dapo: its sampling rounds refill the batch by the rewards of a round, "
                "while a carried batch is the groups that finished; use rollout.partial_rollout off",
            )
        )
    return problems


def _importance_problems(cfg: JobConfig) -> list[Problem]:
    """An agent's episodes span policy versions by design: the update must name how it corrects for the
    older versions' tokens. `decoupled` weights each token's advantage, which a sequence-level ratio
    (GSPO) does not take."""
    rollout, problems = cfg.rollout, []
    if cfg.agent is not None and rollout.importance_correction is None:
        problems.append(
            Problem(
                "rollout.importance_correction",
                f"required with rollout.partial_rollout {rollout.partial_rollout} and agent (an episode's tokens "
                "come from two policy versions): `behaviour` (the ratio against each token's sampling logprob) or "
                "`decoupled` (the ratio against the update's starting policy, a truncated importance weight per "
                "token); docs/agentic.md#episodes-across-a-weight-update",
            )
        )
    if rollout.importance_correction == "decoupled" and cfg.algorithm.name == "gspo":
        problems.append(
            Problem(
                "rollout.importance_correction",
                "`decoupled` with algorithm.name gspo: its ratio and clip are per sequence, the importance weight "
                "per token; use `behaviour`",
            )
        )
    return problems


def _data_problems(cfg: JobConfig) -> list[Problem]:
    """Where the prompts come from: files or a generator, never both or neither."""
    data = cfg.data
    problems: list[Problem] = []
    if (data.generator is None) == (not data.train_files):
        problems.append(
            Problem(
                "data.train_files",
                "set exactly one of data.train_files and data.generator: "
                + ("both are set" if data.train_files else "neither is set"),
            )
        )
    if data.generator is not None and data.val_files:
        problems.append(
            Problem(
                "data.val_files",
                "with data.generator the validation rows are generated (data.generator.num_val_prompts); "
                "leave data.val_files empty or read both splits from files",
            )
        )
    if (data.chosen_key is None) != (data.rejected_key is None):
        problems.append(
            Problem(
                "data.chosen_key" if data.chosen_key is None else "data.rejected_key",
                "preference pairs need both data.chosen_key and data.rejected_key",
            )
        )
    if cfg.algorithm.name == "dpo":
        addition = data.generator is not None and data.generator.name == "addition"
        if not addition and data.chosen_key is None:
            problems.append(
                Problem(
                    "data.chosen_key",
                    "dpo trains on preference pairs: use data.generator addition (which makes them) or "
                    "set data.chosen_key and data.rejected_key to the columns of the chosen and rejected responses",
                )
            )
    return problems


# DAPO (arXiv 2503.14476), sec. 2.3, "Removing KL Divergence".
def _resharding_problems(cfg: JobConfig) -> list[Problem]:
    """Tensor parallelism and resharding: the actor's TP group trains on the same samples, while
    every actor rank is its own generation replica (TP 1) that takes whole prompt groups."""
    algo, training = cfg.algorithm, cfg.training
    tp, ranks = training.tensor_parallel_size, job_layout(cfg).num_actor_ranks
    problems: list[Problem] = []
    if algo.name == "dpo" and (tp > 1 or training.resharding != "naive"):
        problems.append(
            Problem(
                "training.tensor_parallel_size" if tp > 1 else "training.resharding",
                "dpo has no rollout engine to reshard to and its preference update runs without tensor "
                "parallelism; use tensor_parallel_size 1 and resharding naive",
            )
        )
    elif tp > 1 and algo.num_prompts_per_iteration % ranks:
        problems.append(
            Problem(
                "training.tensor_parallel_size",
                f"each of the {ranks} actor ranks generates whole prompt groups, so "
                f"algorithm.num_prompts_per_iteration {algo.num_prompts_per_iteration} must divide by "
                f"data_parallel_size x tensor_parallel_size = {ranks}",
            )
        )
    if cfg.rollout.sleep_level == 2 and (tp > 1 or training.resharding != "naive"):
        problems.append(
            Problem(
                "rollout.sleep_level",
                "level 2 discards the engine's weights and the actor pushes its own again before generating, "
                "which only replicated (DDP) ranks hold: use sleep_level 1, or tensor_parallel_size 1 and "
                "resharding naive",
            )
        )
    if training.lora is not None and (tp > 1 or training.resharding != "naive"):
        problems.append(
            Problem(
                "training.lora",
                "LoRA adapters train on replicated (DDP) ranks only: use tensor_parallel_size 1 and resharding "
                "naive, or unset training.lora",
            )
        )
    return problems


def _generation_tp_problems(cfg: JobConfig) -> list[Problem]:
    """Generation TP: replicas of rollout.tensor_parallel_size consecutive actor ranks, one engine
    each on its first rank, taking whole prompt groups for the replica, on one node (vLLM's TP
    workers of one engine run on the engine's node)."""
    algo, training, layout = cfg.algorithm, cfg.training, job_layout(cfg)
    gen_tp, ranks = layout.generation_tp, layout.num_actor_ranks
    if gen_tp == 1:
        return []
    field = "rollout.tensor_parallel_size"
    if not needs_rollout(algo.name):
        return [Problem(field, f"algorithm.name {algo.name} runs no generation engine; leave {field} at 1")]
    if not layout.generation_divides:
        return [
            Problem(
                field,
                f"{gen_tp} must divide the data_parallel_size x tensor_parallel_size = {ranks} "
                "actor ranks, which form the generation replicas; choose a divisor of it",
            )
        ]
    problems: list[Problem] = []
    replicas = layout.num_generation_replicas
    if algo.num_prompts_per_iteration % replicas:
        problems.append(
            Problem(
                field,
                f"each of the {replicas} generation replicas ({ranks} actor ranks / {gen_tp}) generates whole "
                f"prompt groups, so algorithm.num_prompts_per_iteration {algo.num_prompts_per_iteration} must divide "
                f"by {replicas}",
            )
        )
    if cfg.resources.devices_per_node % gen_tp:
        problems.append(
            Problem(
                field,
                f"one engine's {gen_tp} TP workers run on one node, so {gen_tp} must divide "
                f"resources.devices_per_node ({cfg.resources.devices_per_node})",
            )
        )
    # Combinations not run yet with an engine spanning several ranks (the async pipeline and partial
    # rollout keep per-rank generation state; LoRA merges and level-2 sleep push a rank's own weights).
    for other, value, why in (
        ("training.mode", training.mode == "async", "the async pipeline generates on every actor rank"),
        ("training.lora", training.lora is not None, "LoRA's merged-weight push has run at generation TP 1 only"),
        (
            "rollout.sleep_level",
            cfg.rollout.sleep_level == 2,
            "level 2 re-pushes each rank's own weights, which engine-less ranks do not hold",
        ),
    ):
        if value:
            problems.append(Problem(field, f"{gen_tp} with {other}: {why}; use {field} 1 with it"))
    if cfg.resources.phase_schedule == "serial":
        # The engine's TP workers generate on the replica's other devices, which take no rollout turn.
        problems.append(
            Problem(
                field,
                f"{gen_tp} with resources.phase_schedule serial: the schedule gives the "
                "rollout turn to the engine rank's device only; use phase_schedule overlap "
                f"or {field} 1",
            )
        )
    return problems


def _micro_batch_problems(cfg: JobConfig) -> list[Problem]:
    """training.micro_batch_tokens: passes cut by a token budget need the sorted, trimmed rows, ranks
    free to run different numbers of passes, and no pairs to keep whole."""
    training = cfg.training
    if training.micro_batch_tokens is None:
        return []
    field, budget = "training.micro_batch_tokens", training.micro_batch_tokens
    if not training.trim_padding:
        return [Problem(field, f"a token budget ({budget}) cuts passes of rows sorted by length; set trim_padding")]
    if training.strategy == "fsdp":
        return [
            Problem(
                field,
                f"under strategy fsdp every rank's forward is collective, so ranks must run as many passes; "
                f"a token budget ({budget}) gives each rank its own count: unset it and size micro_batch_size",
            )
        ]
    if cfg.algorithm.name == "dpo":
        return [Problem(field, "DPO's micro-batches hold whole chosen/rejected pairs: unset it")]
    return []


def _context_parallel_problems(cfg: JobConfig) -> list[Problem]:
    """CP (training.context_parallel_size, Ulysses or ring): each CP rank computes a slice of every
    sequence's positions, inside FSDP's data-parallel dimension (its gradient sum over CP is FSDP's
    reduction), beside no TP; Ulysses' heads' divisibility needs the model (`_model_problems`)."""
    training, algo = cfg.training, cfg.algorithm
    cp, field = training.context_parallel_size, "training.context_parallel_size"
    if cp == 1:
        return []
    problems: list[Problem] = []
    if training.tensor_parallel_size > 1:
        problems.append(
            Problem(
                field,
                f"{cp} with tensor_parallel_size {training.tensor_parallel_size}: CP inside TP's head shards is "
                "a layout not built (the CP groups come from FSDP's data-parallel ranks, not a device mesh with "
                "a TP dimension); use one of the two",
            )
        )
    if training.strategy != "fsdp":
        problems.append(
            Problem(
                field,
                f"{cp} runs under strategy fsdp, which shards over data_parallel_size x context_parallel_size ranks "
                "and sums each CP group's gradient shares; set training.strategy: fsdp",
            )
        )
    sequence = algo.max_prompt_length + algo.max_response_length
    if sequence < cp:
        problems.append(
            Problem(
                field,
                f"{cp} CP ranks each compute a slice of a sequence, but sequences hold at most "
                f"max_prompt_length + max_response_length = {sequence} tokens; use a context_parallel_size "
                f"of at most {sequence}",
            )
        )
    return problems


def _expert_parallel_problems(cfg: JobConfig) -> list[Problem]:
    """EP splits the experts over groups of the dp x cp sequence ranks whose other weights FSDP shards
    (runtime engines/expert_parallel.py, the layout in rldock.contract.layout): the groups must tile
    those ranks, and only the FSDP layout composes with them so far."""
    layout, field = job_layout(cfg), "training.expert_parallel_size"
    if layout.ep == 1:
        return []
    problems = []
    if not layout.experts_divide:
        ranks = layout.num_sequence_ranks
        problems.append(
            Problem(
                field,
                f"{layout.ep} must divide the {ranks} sequence ranks, data_parallel_size {layout.dp} x "
                f"context_parallel_size {layout.cp} (EP groups are carved out of them); use a divisor of {ranks}",
            )
        )
    if cfg.training.strategy != "fsdp":
        problems.append(
            Problem(field, f"{layout.ep} needs training.strategy fsdp (experts sharded beside FSDP's shards); set it")
        )
    return problems


def _strategy_problems(cfg: JobConfig) -> list[Problem]:
    """FSDP and its options: FSDP shards the whole model over the DP ranks (no TP layout beside it);
    offload and mixed precision are FSDP2 policies, and mixed precision keeps float32 master weights."""
    training = cfg.training
    problems: list[Problem] = []
    if training.strategy == "fsdp" and training.tensor_parallel_size > 1:
        problems.append(
            Problem(
                "training.strategy",
                f"fsdp shards the whole model over the data-parallel ranks and does not combine with "
                f"tensor_parallel_size {training.tensor_parallel_size}; use tensor_parallel_size 1 or strategy ddp",
            )
        )
    problems += _expert_parallel_problems(cfg)
    if training.strategy == "fsdp":
        # Combinations that have not been built or run with sharded parameters yet.
        for field, value, why in (
            ("training.lora", training.lora, "LoRA adapters train on replicated (DDP) ranks only"),
            ("training.mode", training.mode == "async", "the async pipeline runs with DDP ranks only"),
            (
                "rollout.sleep_level",
                cfg.rollout.sleep_level == 2,
                "level 2 makes the actor push its own replica's weights again, which FSDP ranks do not hold",
            ),
        ):
            if value:
                problems.append(
                    Problem(field, f"{why}: use training.strategy ddp with it, or leave {field} at its default")
                )
    else:
        for name in ("fsdp_cpu_offload", "mixed_precision"):
            if getattr(training, name) not in (False, "none"):
                problems.append(
                    Problem(
                        f"training.{name}",
                        f"applies to strategy fsdp only; set training.strategy: fsdp or leave {name} at its default",
                    )
                )
    if training.mixed_precision != "none" and cfg.model.dtype != "float32":
        problems.append(
            Problem(
                "training.mixed_precision",
                f"{training.mixed_precision} compute keeps float32 master weights, so model.dtype must be float32 "
                f"(got {cfg.model.dtype}); set model.dtype: float32 or mixed_precision: none",
            )
        )
    return problems


def _expert_problems(cfg: JobConfig, config_file: Path) -> list[Problem]:
    """EP and routing replay need an MoE model, whose experts EP divides (read from config.json; a model
    still to be built by model.builder is checked when the actor builds it)."""
    ep, field = cfg.training.expert_parallel_size, "training.expert_parallel_size"
    if not config_file.is_file():
        return []
    config = json.loads(config_file.read_text())
    num_experts = config.get("num_experts", config.get("num_local_experts"))
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
    the MLP evenly (as the actor checks at start); generation TP needs the even split; context
    parallelism splits the heads and KV heads evenly."""
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
        )
    except ValueError as error:
        problems.append(Problem(CP_FIELD, str(error)))
    if tp == 1 and gen_tp == 1:
        return problems
    try:
        check_architecture(tp_size=tp, model_type=config.get("model_type"), field="training.tensor_parallel_size")
        check_divisible(
            tp_size=tp,
            num_heads=config["num_attention_heads"],
            num_kv_heads=config["num_key_value_heads"],
            intermediate_size=config["intermediate_size"],
            field="training.tensor_parallel_size",
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


def _demonstration_problems(cfg: JobConfig) -> list[Problem]:
    """Tool-use demonstrations (data.demonstration_key, a generator's tool_demonstrations) are trained by
    the warm-up after prompts rendered with the agent's tools, and a generator writes them to the column
    data.demonstration_key names (default `demonstration`), so the two settings go together."""
    data, generator = cfg.data, cfg.data.generator
    tool = generator.tool_demonstrations if generator is not None else None
    problems: list[Problem] = []
    if generator is not None and tool is None and data.demonstration_key is not None:
        problems.append(
            Problem(
                "data.demonstration_key",
                f"the {generator.name} generator writes demonstrations only with data.generator.tool_demonstrations; "
                "set that (python or calculator) or leave data.demonstration_key unset",
            )
        )
    if cfg.agent is None and (tool is not None or data.demonstration_key is not None):
        problems.append(
            Problem(
                "data.generator.tool_demonstrations" if tool is not None else "data.demonstration_key",
                "demonstrations show the model calling tools, which only a job with an agent section renders and "
                "runs; add agent (with agent.tools) or drop the demonstrations",
            )
        )
    if cfg.agent is not None and tool is not None and tool not in {spec.name for spec in cfg.agent.tools}:
        problems.append(
            Problem(
                "data.generator.tool_demonstrations",
                f"the demonstrations call the {tool} tool, which agent.tools does not list; add {{name: {tool}}} "
                "to agent.tools or demonstrate a tool the job has",
            )
        )
    return problems
