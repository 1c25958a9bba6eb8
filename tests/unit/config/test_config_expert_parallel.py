"""Config rules for expert parallelism (training.expert_parallel_size) and the router's loss weight."""

import json

import pytest
from job_examples import example, problem_paths

from rldock.config import find_local_problems, parse_job_config
from rldock.config.job_layout import job_layout


@pytest.fixture
def demo_data() -> dict:
    data = example()
    data["training"].update(strategy="fsdp", data_parallel_size=4)
    data["resources"]["devices_per_node"] = 4
    return data


def test_defaults_are_no_ep_and_the_models_router_coef(demo_data):
    training = parse_job_config(example()).training
    assert (training.expert_parallel_size, training.router_aux_loss_coef) == (1, None)


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_dividing_dp_under_fsdp_is_valid_and_in_the_layout(demo_data, ep):
    demo_data["training"]["expert_parallel_size"] = ep
    layout = job_layout(parse_job_config(demo_data))
    # EP carves its groups out of the DP ranks: no extra ranks or devices
    assert (layout.ep, layout.expert_data_parallel, layout.num_actor_ranks) == (ep, 4 // ep, 4)


def test_ep_not_dividing_dp_is_named(demo_data):
    demo_data["training"]["expert_parallel_size"] = 3
    assert problem_paths(demo_data) == ["training.expert_parallel_size"]


def test_ep_without_fsdp_is_named(demo_data):
    demo_data["training"].update(strategy="ddp", expert_parallel_size=2)
    assert problem_paths(demo_data) == ["training.expert_parallel_size"]


def _local_problems(data: dict, tmp_path, config: dict) -> list[str]:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    data["model"] = {"path": str(model_dir)}
    return [f"{p.path}: {p.message}" for p in find_local_problems(parse_job_config(data))]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"model_type": "qwen3_moe", "num_local_experts": 6}, "must divide the model's 6 experts"),
        ({"model_type": "mixtral", "num_local_experts": 8}, None),
        ({"model_type": "qwen2"}, "needs an MoE model"),
    ],
)
def test_the_models_experts_must_split_over_ep(demo_data, tmp_path, config, expected):
    demo_data["training"]["expert_parallel_size"] = 4
    problems = _local_problems(demo_data, tmp_path, {"num_hidden_layers": 2, **config})
    if expected is None:
        assert problems == []
    else:
        assert (
            len(problems) == 1 and problems[0].startswith("training.expert_parallel_size") and expected in problems[0]
        )


@pytest.mark.parametrize(("ep", "expert_dp"), [(2, 2), (4, 1)])
def test_ep_over_context_parallel_ranks_is_valid_and_in_the_layout(demo_data, ep, expert_dp):
    """EP groups are carved out of the dp x cp sequence ranks (rldock.contract.layout): at EP 4 they
    span both CP groups of 2 data-parallel ranks."""
    demo_data["training"].update(data_parallel_size=2, context_parallel_size=2, expert_parallel_size=ep)
    layout = job_layout(parse_job_config(demo_data))
    assert (layout.expert_data_parallel, layout.num_actor_ranks) == (expert_dp, 4)


def test_ep_not_dividing_the_sequence_ranks_is_named(demo_data):
    demo_data["training"].update(data_parallel_size=2, context_parallel_size=2, expert_parallel_size=8)
    assert problem_paths(demo_data) == ["training.expert_parallel_size"]
