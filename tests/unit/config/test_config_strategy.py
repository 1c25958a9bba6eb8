"""Config rules for the data-parallel strategy (training.strategy, fsdp_cpu_offload, mixed_precision)."""

import pytest
from job_examples import example, problem_messages, problem_paths

from rldock.config import parse_job_config


@pytest.fixture
def demo_data() -> dict:
    return example()


def test_defaults_are_ddp_without_extras(demo_data):
    training = parse_job_config(demo_data).training
    assert (
        training.strategy,
        training.fsdp_cpu_offload,
        training.gradient_checkpointing,
        training.mixed_precision,
    ) == ("ddp", False, False, "none")


def test_fsdp_with_every_option_is_valid(demo_data):
    demo_data["training"].update(
        strategy="fsdp",
        fsdp_cpu_offload=True,
        gradient_checkpointing=True,
        mixed_precision="bf16",
        resharding="allgather_swap",
    )
    assert parse_job_config(demo_data).training.strategy == "fsdp"


def test_fsdp_composes_with_tensor_parallelism_and_beside_it_expert_parallelism(demo_data):
    demo_data["training"].update(strategy="fsdp", data_parallel_size=2, tensor_parallel_size=2)
    demo_data["resources"]["devices_per_node"] = 4
    assert parse_job_config(demo_data).training.tensor_parallel_size == 2
    demo_data["training"]["expert_parallel_size"] = 2  # EP 2 over each TP rank's 2 data-parallel ranks
    assert parse_job_config(demo_data).training.expert_parallel_size == 2
    demo_data["training"]["expert_parallel_size"] = 4  # but not over 4: they are 2
    assert problem_paths(demo_data) == ["training.expert_parallel_size"]


@pytest.mark.parametrize("field,value", [("fsdp_cpu_offload", True), ("mixed_precision", "bf16")])
def test_fsdp_options_without_fsdp_are_named(demo_data, field, value):
    demo_data["training"][field] = value
    assert problem_paths(demo_data) == [f"training.{field}"]


def test_mixed_precision_needs_float32_masters(demo_data):
    demo_data["training"].update(strategy="fsdp", mixed_precision="fp16")
    demo_data["model"]["dtype"] = "bfloat16"
    assert problem_paths(demo_data) == ["training.mixed_precision"]


def test_unknown_strategy_is_refused(demo_data):
    demo_data["training"]["strategy"] = "zero2"
    assert problem_paths(demo_data) == ["training.strategy"]


def test_paper_examples_are_valid():
    for name in ("grpo-qwen2.5-7b-paper.yaml", "grpo-qwen2.5-32b-paper.yaml", "grpo-deepseek-r1-671b-paper.yaml"):
        cfg = parse_job_config(example(name))
        assert cfg.training.strategy == "fsdp" and cfg.resources.device_memory_gib == 64


def test_a_token_budget_is_valid_with_trimmed_ddp_passes(demo_data):
    demo_data["training"]["micro_batch_tokens"] = 512
    assert parse_job_config(demo_data).training.micro_batch_tokens == 512


@pytest.mark.parametrize(
    "training,algorithm,words",
    [
        ({"trim_padding": False}, {}, "set trim_padding"),
        ({"strategy": "fsdp"}, {}, "as many passes"),
        ({}, {"name": "dpo"}, "whole chosen/rejected pairs"),
    ],
)
def test_a_token_budget_names_what_it_cannot_go_with(demo_data, training, algorithm, words):
    demo_data["training"].update(micro_batch_tokens=512, **training)
    demo_data["algorithm"].update(algorithm)
    from rldock.config import find_problems
    from rldock.config.job import JobConfig

    cfg = JobConfig.model_validate(demo_data)
    budget = [p for p in find_problems(cfg) if p.path == "training.micro_batch_tokens"]
    assert len(budget) == 1 and words in budget[0].message


def test_hsdp_replicas_tile_the_data_parallel_ranks_under_fsdp(demo_data):
    demo_data["training"].update(strategy="fsdp", data_parallel_size=4, data_parallel_replicate_size=2)
    assert parse_job_config(demo_data).training.data_parallel_replicate_size == 2
    for training, says in (
        ({"data_parallel_replicate_size": 3}, "must divide data_parallel_size 4"),
        ({"strategy": "ddp"}, "need training.strategy fsdp"),
    ):
        bad = {**demo_data, "training": {**demo_data["training"], **training}}
        assert problem_paths(bad) == ["training.data_parallel_replicate_size"], training
        assert says in problem_messages(bad, "training.data_parallel_replicate_size")[0]
    # beside EP: the experts' FSDP spans the replicas
    demo_data["training"]["expert_parallel_size"] = 2
    assert parse_job_config(demo_data).training.expert_parallel_size == 2


def test_pipeline_stages_run_under_fsdp_with_or_without_tp_and_add_ranks(demo_data):
    from rldock.config.job_layout import job_layout

    demo_data["training"].update(
        strategy="fsdp", data_parallel_size=1, pipeline_parallel_size=2, tensor_parallel_size=2
    )
    demo_data["resources"]["devices_per_node"] = 4
    cfg = parse_job_config(demo_data)
    assert job_layout(cfg).num_actor_ranks == 4  # pp 2 x dp 1 x tp 2
    ddp = {**demo_data, "training": {**demo_data["training"], "strategy": "ddp", "tensor_parallel_size": 1}}
    assert problem_paths(ddp) == ["training.pipeline_parallel_size"]
    assert "runs under strategy fsdp" in problem_messages(ddp, "training.pipeline_parallel_size")[0]
    cp = {**demo_data, "training": {**demo_data["training"], "tensor_parallel_size": 1, "context_parallel_size": 2}}
    assert job_layout(parse_job_config(cp)).num_actor_ranks == 4  # pp 2 x cp 2: each stage's CP pair
    ep = {**demo_data, "training": {**demo_data["training"], "tensor_parallel_size": 1, "expert_parallel_size": 2}}
    ep["training"]["data_parallel_size"] = 2
    # PP 2 x EP 2 over each stage's DP pair, the router's load-balancing loss on (the model config's weight)
    assert parse_job_config(ep).training.expert_parallel_size == 2
    ep["algorithm"] = {**ep["algorithm"], "routing_replay": "reference"}  # each stage replays its own layers
    assert parse_job_config(ep).algorithm.routing_replay == "reference"
    ppo = {**demo_data, "algorithm": {**demo_data["algorithm"], "name": "ppo"}}
    # the critic's value model is cut into the same stages: pp 2 x dp 1 critic ranks, no refusal
    assert job_layout(parse_job_config(ppo)).num_ranks("stage_sequence_ranks") == 2
    # the stages' ranks are counted against the devices
    demo_data["resources"]["devices_per_node"] = 2
    says = problem_messages(demo_data, "training.pipeline_parallel_size")
    assert "pipeline_parallel_size x data_parallel_size x tensor_parallel_size = 4 actor ranks" in says[0]
