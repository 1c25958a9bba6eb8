"""`training`: how the update runs (docs/placement.md, docs/resharding.md): the strategy (DDP, FSDP),
the parallel sizes (data, tensor, context, expert), micro-batches, precision, LoRA and the resharding
between training and generation, with the checks that need more than one field (`problems`,
rldock.config.problems.SECTION_CHECKS)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, StringConstraints

from rldock.config.job_layout import job_layout
from rldock.config.parallel_problems import parallel_problems
from rldock.config.problem import Problem
from rldock.config.section import MAX_NAME_LENGTH, Spec
from rldock.contract.context_parallel import ContextParallelMode

if TYPE_CHECKING:
    from rldock.config.job import JobConfig


class LoraSpec(Spec):
    """Low-rank adapters (LoRA, with peft) instead of full fine-tuning: only the adapters train, the
    engine gets the base weights with the adapters merged in at every sync, and the reference
    policy is the same model with its adapters switched off (no second copy, no reference ranks)."""

    rank: int = Field(default=8, ge=1, le=1024, description="r: rank of each adapter's A (r x in) and B (out x r).")
    alpha: float = Field(
        default=16.0, gt=0, le=1e6, description="Scaling numerator: the adapter's update is B A x * alpha / rank."
    )
    target_modules: list[Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_LENGTH)]] = Field(
        default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        max_length=64,
        description="Names (last component) of the Linear modules that get an adapter; the default covers the "
        "attention and MLP projections of Llama, Qwen2 and Qwen3.",
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input while training.")


class TrainingSpec(Spec):
    """How the actor is trained: data and tensor parallelism, micro-batching, resharding to generation.
    Data parallelism is DDP (full replicas, with tensor_parallel_size 1), FSDP2 (`strategy: fsdp`:
    parameters, gradients and optimizer state sharded over the data-parallel ranks, over TP's shards
    with tensor_parallel_size > 1) or the TP x DP layout (docs/scaling.md)."""

    strategy: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description="Data-parallel wrapper of the actor ranks and the PPO critic ranks. `ddp`: "
        "every rank holds the whole model, its gradients and AdamW state. `fsdp`: PyTorch FSDP2 "
        "(`fully_shard` per decoder layer): each "
        "rank keeps 1/data_parallel_size of them and gathers a layer's weights only while computing it "
        "(ZeRO-3); the engine receives the gathered full weights after each update. With "
        "tensor_parallel_size > 1 the layers' linears are split over TP first and FSDP shards those shards "
        "(FSDP x TP, docs/scaling.md).",
    )
    fsdp_cpu_offload: bool = Field(
        default=False,
        description="`strategy: fsdp` only: keep the sharded parameters, gradients and optimizer state in host "
        "memory and copy each layer to the device for its forward/backward (FSDP2's CPUOffloadPolicy; the "
        "optimizer steps on the host). Frees the device of all training state at the cost of host copies.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Keep only each decoder layer's input during the forward pass and recompute the layer in "
        "backward (non-reentrant activation checkpointing): activations shrink to about one layer's worth "
        "plus a hidden state per layer, for about one extra forward pass of compute.",
    )
    mixed_precision: Literal["none", "bf16", "fp16"] = Field(
        default="none",
        description="`strategy: fsdp` only: `bf16`/`fp16` run forward and backward in that dtype while the "
        "sharded master weights, gradients, optimizer state and the gradient reduction stay float32 "
        "(needs model.dtype float32; FSDP2's MixedPrecisionPolicy). `fp16` has no loss scaling, so prefer "
        "`bf16`. Refused at start on a device without that dtype. `none`: compute in model.dtype.",
    )

    mode: Literal["sync", "async"] = Field(
        default="sync",
        description="`sync`: each iteration generates, scores and trains on its own samples before the next "
        "starts. `async`: the next iteration's prompts go into a second dock bank and its generation, "
        "old-logprob, reference, reward and advantage stages run before this iteration's update "
        "(one-step off-policy, as in AReaL/StreamRL), so they overlap it; samples are then one policy "
        "version old. The pipeline runs ahead only while dock.max_staleness allows: with 0 it runs as "
        "`sync` (see docs/transfer-dock.md, asynchronous training).",
    )
    data_parallel_size: int = Field(
        default=1,
        ge=1,
        description="DP: actor ranks, each on one device (times tensor_parallel_size); PPO's critic runs as many "
        "data-parallel ranks (times context_parallel_size and pipeline_parallel_size, never TP-split).",
    )
    data_parallel_replicate_size: int = Field(
        default=1,
        ge=1,
        description="HSDP: under strategy fsdp, the data-parallel ranks form this many replicas of "
        "data_parallel_size / data_parallel_replicate_size ranks; FSDP shards the model within a replica (over "
        "its ranks x context_parallel_size) and the replicas all-reduce their shards' gradients, so a "
        "rank holds 1/(the replica's ranks) of the state rather than 1/(all of them) but the "
        "parameter all-gathers stay inside a replica (a node, say). Must divide data_parallel_size; 1: "
        "every data-parallel rank shards (FSDP). Beside expert_parallel_size the experts are sharded over their "
        "expert-data-parallel ranks, across the replicas (docs/scaling.md, section 11).",
    )
    expert_parallel_size: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="EP: the training ranks that split an MoE model's experts (Qwen3-MoE, Mixtral, DeepSeek-V3): each "
        "holds num_experts / expert_parallel_size of every MoE layer's experts and its tokens reach the others' by "
        "all-to-all; the rest of the model is sharded over all ranks. It carves groups out of the "
        "data_parallel_size x context_parallel_size ranks (which it must divide; under CP a group may hold or "
        "span CP groups), adds no ranks, and must divide the model's experts. Needs "
        "strategy fsdp (docs/scaling.md, expert parallelism). Checkpoints and the engine's weights stay in the "
        "Hugging Face layout whatever the size.",
    )
    router_aux_loss_coef: float | None = Field(
        default=None,
        ge=0,
        description="MoE models: the weight of the router's load-balancing loss (Switch Transformer's, as Hugging "
        "Face computes it) added to the update's loss, over the micro-batch's real tokens. Unset: the model "
        "config's router_aux_loss_coef (Qwen3-MoE's 0.001); 0: none. Ignored for a dense model.",
    )
    micro_batch_size: int = Field(default=32, ge=1, description="Samples per forward/backward pass (at most).")
    micro_batch_tokens: int | None = Field(
        default=None,
        ge=1,
        description="A token budget per forward/backward pass of the old-logprob, reference and update passes: "
        "samples sorted by length fill a pass while its rows x (longest prompt + longest response) stays "
        "within this (a longer sample runs alone), at most micro_batch_size of them, so short samples share a "
        "pass and long ones are not padded to each other. Needs trim_padding; not with strategy fsdp (whose "
        "ranks must run as many passes as each other) or DPO (whose micro-batches hold whole pairs). Unset: "
        "micro_batch_size samples per pass.",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="TP: actor ranks that split each layer's weights, any size that divides the model's attention "
        "heads, KV heads and MLP width (Llama, Qwen2, Qwen3; checked against the model's config.json). The actor runs "
        "data_parallel_size x tensor_parallel_size ranks and reshards into generation by allgather after every "
        "update; generation's own TP is rollout.tensor_parallel_size (default 1: one vLLM engine per actor rank). "
        "Under strategy fsdp, FSDP shards TP's shards over the data-parallel (x context-parallel) ranks; a "
        "mixture-of-experts model (Qwen3-MoE, DeepSeek-V3: its latent attention by heads) splits its attention by "
        "TP and its experts by expert_parallel_size.",
    )
    context_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="CP: context parallelism for long sequences. Each data-parallel rank's samples are "
        "computed by this many ranks, each holding 1/context_parallel_size of every sequence's positions; "
        "attention sees the whole sequence by context_parallel_mode (Ulysses' all-to-all over heads, which this "
        "must divide, or ring attention), and the passes' attention must take a 4D mask (sdpa or eager, no "
        "sliding window). Activations per rank fall by this factor (`rldock plan` counts them and says when a "
        "sequence length needs it); FSDP shards over data_parallel_size x context_parallel_size ranks. Needs "
        "strategy fsdp; composes with tensor_parallel_size (CP over each TP rank's heads: Ulysses' size must "
        "divide the heads and KV heads by tensor_parallel_size x this), expert_parallel_size, "
        "pipeline_parallel_size and routing replay. `rldock train` runs the actor's, "
        "the reference's and the critic's ranks as data_parallel_size groups of this many (each group's first "
        "rank reads the group's samples from the dock and shares them), the policy's, the reference's and the "
        "critic's passes under the context_parallel_mode (docs/scaling.md, section 9).",
    )
    pipeline_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="PP: pipeline stages the decoder layers split into (as evenly as the count allows, the spare "
        "layers on the first stages), each on its own ranks: the actor runs pipeline_parallel_size x "
        "data_parallel_size x context_parallel_size x tensor_parallel_size ranks (the reference and PPO's "
        "critic, cut into the same stages, pipeline_parallel_size x data_parallel_size x "
        "context_parallel_size). The update runs its "
        "micro-batches on a 1F1B schedule (its idle share is (stages - 1) / (micro-batches + stages - 1): more "
        "micro-batches per mini-batch, a smaller bubble); the old-logprob pass streams its passes through the "
        "stages. Needs "
        "strategy fsdp (each stage sharded over its data-parallel ranks); composes with tensor_parallel_size, "
        "context_parallel_size (each stage's CP ranks split the positions) and expert_parallel_size (the "
        "router's load-balancing loss taken on the last stage from every stage's routing; routing replay: each "
        "stage replays its own layers' routing), and runs DPO's "
        "preference step and PPO's critic (its value model's update on the same schedule; docs/scaling.md, "
        "section 12).",
    )
    context_parallel_mode: ContextParallelMode = Field(
        default="ulysses",
        description="How the CP ranks attend over the whole sequence. `ulysses`: an all-to-all gives each rank "
        "1/context_parallel_size of the heads over every position, so the size must divide the attention heads and "
        "KV heads. `ring`: each rank keeps every head of its own positions and the keys and values pass around "
        "the CP group (context_parallel_size - 1 steps, their log-sum-exps merged), so any size fits the heads; "
        "it moves only the keys and values, where Ulysses moves the queries and the output too "
        "(docs/scaling.md, section 9).",
    )
    trim_padding: bool = Field(
        default=True,
        description="Compute no padding in the old-logprob, reference, critic and update passes. Where the "
        "model's attention takes a 4D mask (sdpa, eager; no sliding window) and it costs fewer FLOPs, a "
        "micro-batch is packed: its samples laid end to end in one sequence, each prompt once for the "
        "responses that share it (a GRPO group), none padded. Otherwise each micro-batch runs on its longest "
        "sequence only (prompt columns that are padding in every row and response columns past the longest "
        "response are cut) with samples sorted by length. Results are the same up to float rounding. "
        "`false` computes on the dock's full PL + SL columns (for comparison).",
    )
    num_threads: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="Torch (and in-process vLLM) threads of each compute worker process (actor, reference, "
        "critic ranks). Unset: the node's cores divided by the compute workers on that node, at least 1, "
        "so workers do not oversubscribe the cores. 0: leave the process default (Ray's OMP_NUM_THREADS, "
        "the worker's num_cpus). n: n threads each.",
    )
    freeze_embeddings: bool = Field(
        default=False,
        description="Keep the token embeddings and the LM head (one matrix when tied, as in SmolLM2) fixed: no "
        "gradients or optimizer state for the vocabulary-sized weights (SmolLM2-135M: 28M of 135M parameters) "
        "and a cheaper backward; the transformer layers still train. vLLM still receives every weight.",
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="Train low-rank adapters instead of every weight (docs/placement.md#lora); unset: full "
        "fine-tuning. Needs tensor_parallel_size 1 and resharding `naive`.",
    )
    resharding: Literal["naive", "allgather_swap"] = Field(
        default="naive",
        description="How the actor moves from its update to generation. `naive`: the training state stays on "
        "the device during generation (with tensor_parallel_size 1: DDP and an in-memory weight push). "
        "`allgather_swap`: the TP shards are gathered into a temporary buffer, loaded into the engine, "
        "then params, grads and optimizer state are swapped to host and the buffer freed, so no training "
        "tensor stays on the device while generating (see docs/resharding.md).",
    )


def problems(cfg: JobConfig) -> list[Problem]:
    return [
        *_resharding_problems(cfg),
        *_strategy_problems(cfg),
        *parallel_problems(cfg),
        *_micro_batch_problems(cfg),
    ]


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


def _strategy_problems(cfg: JobConfig) -> list[Problem]:
    """FSDP and its options: FSDP shards the model over the DP ranks, TP's shards where TP splits the layers
    (beside expert parallelism too: each TP rank's sequence ranks hold the experts); offload and mixed
    precision are FSDP2 policies, and mixed precision keeps float32 master weights."""
    training = cfg.training
    problems: list[Problem] = []
    if training.strategy == "fsdp":
        # Combinations that have not been built or run with sharded parameters yet.
        for field, value, why in (
            ("training.lora", training.lora, "LoRA adapters train on replicated (DDP) ranks only"),
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
