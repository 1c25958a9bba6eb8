"""The job configuration: one pydantic model tree that is the rldock API.

The same models are read from YAML by `rldock train`, embedded as the RLJob spec by the operator
and turned into the CRD schema and the reference docs, so every field carries a description and
its bounds. Only single-field rules live in the models; rules across fields are checks that return
`Problem`s, so the operator can report them as conditions on an object the API server already
accepted. A section with a module of its own (agent.py, agent_environment.py, algorithm.py,
data.py, dock.py, evaluation.py, monitoring.py, reward.py, rollout.py, rollout_correction.py,
training.py) keeps its checks beside its fields; the others' (those across the model, the
resources and the workers) are in `problems.py`, which gathers all. The fields' shared vocabulary
(string bounds, `Expanded`, a user's class reference) is section.py's.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
)

from rldock.config.agent import AgentSpec
from rldock.config.algorithm import AlgorithmSpec
from rldock.config.data import DataSpec, demo_data
from rldock.config.dock import DockSpec
from rldock.config.evaluation import EvaluationSpec
from rldock.config.monitoring import MonitoringSpec
from rldock.config.reward import RewardSpec
from rldock.config.rollout import RolloutSpec
from rldock.config.section import (
    MAX_NAME_LENGTH,
    MAX_PATH_LENGTH,
    PATH,
    Spec,
)
from rldock.config.training import TrainingSpec
from rldock.contract.placement import PlacementMode


class ModelSpec(Spec):
    """The policy model to start from (also the reference policy when no warm-up runs)."""

    path: Annotated[str, PATH] = Field(
        max_length=MAX_PATH_LENGTH,
        description="Directory of a Hugging Face format causal LM (config.json, tokenizer files, "
        "weights) loaded with save_pretrained/from_pretrained conventions.",
    )
    builder: Literal["tiny-qwen2", "tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-deepseek-v3"] | None = Field(
        default=None,
        description="If set and `path` holds no model yet, build this tiny model (with a tokenizer "
        "trained on the train prompts and answers) and save it at `path`: `tiny-qwen2` (the demo's), or the same "
        "shapes as `tiny-llama` or `tiny-qwen3`, or `tiny-qwen3-moe` (4 experts, 2 per token, an MLP of the same "
        "active width), or `tiny-deepseek-v3` (that MoE with DeepSeek-V3's latent attention, a dense first layer, "
        "a shared expert and its sigmoid router). For demos and tests; leave unset for real checkpoints "
        "(see docs/bring-your-own.md).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32",
        description="Parameter dtype for training, and for generation unless `rollout.dtype` sets another.",
    )


class WarmupSpec(Spec):
    """A short supervised phase before RL starts: on the train prompts' reference answers, or where the
    rows carry demonstrations (`data.demonstration_key`) on the model's turns of those."""

    steps: int = Field(default=0, ge=0, description="Supervised steps before RL; 0 disables.")
    learning_rate: float = Field(default=1e-3, ge=0, description="AdamW learning rate.")
    batch_size: int = Field(default=64, ge=1, description="Examples per supervised step.")


class ResourcesSpec(Spec):
    """Devices the job runs on: device kind, nodes and accelerators per node."""

    device: Literal["auto", "npu", "cuda", "cpu"] = Field(
        default="auto", description="Torch device kind; `auto` picks npu, then cuda, then cpu."
    )
    accelerator_resource: str = Field(
        max_length=MAX_NAME_LENGTH,
        default="NPU",
        min_length=1,
        description="Ray resource name that workers request per device.",
    )
    num_nodes: int = Field(default=1, ge=1, description="Nodes of the Ray cluster.")
    devices_per_node: int = Field(default=8, ge=1, description="Accelerators per node.")
    placement: PlacementMode = Field(
        default="colocated",
        description="How workers share devices (one Ray placement group bundle per device; docs/placement.md). "
        "Every actor rank always has a device of its own, so TP peers sit on distinct devices and each device "
        "runs one generation engine. `colocated`: each worker takes half a device; each reference rank shares "
        "an actor rank's device and the critic and reward model take the halves left over (the MindSpeed RL "
        "all-in-one placement). `separate`: reference ranks, critic and reward model each get a whole device.",
    )
    phase_schedule: Literal["auto", "serial", "overlap"] = Field(
        default="auto",
        description="Whether workers that share a device run their heavy phases one at a time (docs/placement.md). "
        "`serial`: on every shared device the iteration's phases (rollout, old logprobs, reference, critic "
        "inference, update, critic update, as the recipe runs them) take turns in one order common to all "
        "devices, so a phase gets the device's compute and memory to itself and never overlaps its neighbour's. "
        "`overlap`: every stage starts at once and waits only on the dock. `auto`: serial on npu/cuda with "
        "`colocated` placement in a training.mode sync job, overlap on CPU (each worker's thread budget is its "
        "share) and under `separate` (no device is shared).",
    )
    device_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=65536,
        description="Memory of one device, GiB (64 on an Ascend 910B, 80 on an H100): what `rldock plan` checks "
        "the job against when no --device-memory is given. Unset: the plan prints the bytes without a verdict.",
    )
    peak_tflops: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description="Peak dense matmul throughput of one device, TFLOP/s (the whole CPU on a CPU job), for every "
        "stage: the denominator of the `mfu/<stage>` metrics (docs/evaluation.md). Unset: what `rldock bench peak` "
        "measured on the job's device in the dtype each stage computes in, read from its cache or measured once "
        "(a few seconds) when the job starts.",
    )
    memory_bandwidth_gbps: float | None = Field(
        default=None,
        gt=0,
        le=1_000_000,
        description="Memory bandwidth of one device, GB/s: the denominator of `mbu/rollout`, the decode's bytes of "
        "weights and KV cache read per second. Unset: measured by `rldock bench peak` as `peak_tflops` is.",
    )


class CheckpointSpec(Spec):
    """When checkpoints are written and how many are kept."""

    interval: int = Field(default=5, ge=1, description="Save every this many iterations (and at the end).")
    keep_last: int = Field(default=2, ge=1, description="Checkpoints kept; older ones are deleted.")


class Ablations(BaseModel):
    """Optimisations that the benchmarks (rldock_benchmarks) turn off to measure what each one gains.

    Not part of the job config: a JobConfig holds them in a private attribute, which no YAML file,
    RLJob or CRD can reach (a config naming one of these fields is refused as an unknown field); a
    benchmark sets them in code (`JobConfig.with_ablations`). Each defaults to the optimisation on.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The reward worker computes each prompt group's advantages as it scores the group and writes
    # them with the rewards, where the recipe can (grpo, dapo): no advantage state, two Ray round
    # trips and a wake-up fewer per iteration. Off: the separate advantage worker.
    fuse_reward_advantage: bool = True
    # The driver's counters, records and (sync) staleness bound run in a background thread while the
    # next iteration starts (runtime/driver/bookkeeping.py). Off: inline, between iterations.
    background_bookkeeping: bool = True
    # Distributed dock: the controllers hold the first warehouse node's warehouses in their process,
    # a put or get there one Ray call instead of two. Off: every warehouse an actor of its own.
    colocate_controllers: bool = True
    # Distributed dock: warehouses keep columns in /dev/shm and workers on their node move rows there
    # themselves. Off: rows travel through Ray's object store.
    shared_memory: bool = True


class WandbSpec(Spec):
    """The Weights & Biases run, when `tracking` lists `wandb`. The API key is read from the
    WANDB_API_KEY environment variable (in an RLJob from a Secret, docs/operator.md); with
    WANDB_MODE=offline the run is written under the output directory and needs no network."""

    project: str = Field(
        default="rldock", min_length=1, max_length=MAX_NAME_LENGTH, description="W&B project the run is logged to."
    )
    entity: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_NAME_LENGTH,
        description="W&B entity (user or team); unset: the API key's default entity.",
    )


class JobConfig(Spec):
    """One RL post-training job."""

    _ablations: Ablations = PrivateAttr(default_factory=Ablations)

    name: str = Field(
        default="rldock-job", min_length=1, max_length=MAX_NAME_LENGTH, description="Job name used in logs and outputs."
    )
    seed: int = Field(default=0, ge=0, description="Seed for data order, sampling and initialisation.")
    iterations: int = Field(ge=1, description="RL iterations to run.")
    model: ModelSpec
    data: DataSpec = Field(
        default_factory=demo_data,
        description="Prompts and reference answers; unset: the `addition` generator with `chat_template: none`, "
        "allowed only with `model.builder` (a model of your own needs its data named).",
    )
    reward: RewardSpec = Field(default_factory=RewardSpec)
    warmup: WarmupSpec = Field(default_factory=WarmupSpec)
    algorithm: AlgorithmSpec
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    agent: AgentSpec | None = Field(
        default=None,
        description="Multi-turn rollouts with tools and an environment (docs/agentic.md); unset: one generation "
        "per sample.",
    )
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    dock: DockSpec = Field(default_factory=DockSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    monitoring: MonitoringSpec = Field(default_factory=MonitoringSpec)
    tracking: list[Literal["tensorboard", "wandb"]] = Field(
        default=["tensorboard"],
        max_length=2,
        description="Where each iteration's metrics go besides metrics.jsonl: `tensorboard` (event files in the "
        "output directory) and `wandb` (Weights & Biases, see `wandb`).",
    )
    wandb: WandbSpec = Field(default_factory=WandbSpec)

    @property
    def ablations(self) -> Ablations:
        """The optimisations a benchmark turned off (all on unless `with_ablations` said otherwise)."""
        return self._ablations

    def with_ablations(self, **switches: bool) -> JobConfig:
        """A copy with these `Ablations` fields set (benchmarks only; unknown names raise)."""
        copy = self.model_copy()
        copy._ablations = Ablations(**{**self._ablations.model_dump(), **switches})
        return copy

    @property
    def rows_per_episode(self) -> int:
        """S: the dock rows of one episode (a sample): agent.max_segments for a harness's episodes, whose
        segments each train; 1 otherwise."""
        return self.agent.max_segments if self.agent is not None and self.agent.harnessed else 1

    @property
    def rows_per_group(self) -> int:
        """N*S: the dock rows of one prompt group, consecutive."""
        return self.algorithm.num_responses_per_prompt * self.rows_per_episode

    @property
    def num_samples_per_iteration(self) -> int:
        """G*N*S: the dock rows that flow through the dock per iteration (S = rows_per_episode, 1 but for a
        harness's segments)."""
        return self.algorithm.num_prompts_per_iteration * self.rows_per_group

    @property
    def num_devices(self) -> int:
        return self.resources.num_nodes * self.resources.devices_per_node
