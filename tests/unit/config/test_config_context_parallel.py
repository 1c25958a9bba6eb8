"""Config rules for context parallelism (training.context_parallel_size): the layout it makes, the
layouts `validate` refuses, each naming the field, and the heads the model must split."""

import pytest
from job_examples import example, problem_messages, problem_paths

from rldock.config import find_local_problems, parse_job_config
from rldock.config.job_layout import job_layout

FIELD = "training.context_parallel_size"


@pytest.fixture
def demo_data() -> dict:
    data = example()  # DP 2 on 8 devices, the tiny Qwen2 (4 heads, 2 KV heads) still to be built
    data["training"]["strategy"] = "fsdp"
    return data


def test_cp_inside_fsdp_is_valid_and_multiplies_the_ranks_once(demo_data):
    demo_data["training"]["context_parallel_size"] = 2
    layout = job_layout(parse_job_config(demo_data))
    assert (layout.dp, layout.cp, layout.num_actor_ranks, layout.num_ranks("sequence_ranks")) == (2, 2, 4, 4)


@pytest.mark.parametrize(
    ("training", "algorithm", "says"),
    [
        ({"strategy": "ddp"}, {}, "set training.strategy: fsdp"),
        ({}, {"max_prompt_length": 1, "max_response_length": 1}, "of at most 2"),
    ],
    ids=["ddp", "shorter-than-cp"],
)
def test_impossible_layouts_name_the_field(demo_data, training, algorithm, says):
    demo_data["training"].update(context_parallel_size=4, **training)
    demo_data["algorithm"].update(algorithm)
    assert FIELD in problem_paths(demo_data)
    assert any(says in message for message in problem_messages(demo_data, FIELD))


def test_more_ranks_than_devices_names_the_cp_size(demo_data):
    demo_data["training"]["context_parallel_size"] = 8  # DP 2 x CP 8 = 16 ranks on 8 devices
    assert problem_paths(demo_data) == [FIELD]
    assert "data_parallel_size x context_parallel_size = 16 actor ranks" in problem_messages(demo_data, FIELD)[0]


@pytest.mark.parametrize(("cp", "refused"), [(2, False), (4, True)])
def test_the_models_kv_heads_must_divide_by_cp(demo_data, cp, refused):
    demo_data["training"].update(context_parallel_size=cp, data_parallel_size=1)
    problems = find_local_problems(parse_job_config(demo_data))
    assert [p.path for p in problems] == ([FIELD] if refused else [])
    if refused:
        assert "num_key_value_heads=2" in problems[0].message


@pytest.mark.parametrize(("mode", "refused"), [("ulysses", True), ("ring", False)])
def test_cp_over_tp_splits_a_tp_rank_s_heads(demo_data, mode, refused):
    # CP 2 x TP 2 under FSDP: 4 actor ranks, 2 sequence ranks (the reference and the critic have no TP)
    demo_data["training"].update(
        context_parallel_size=2, tensor_parallel_size=2, data_parallel_size=1, context_parallel_mode=mode
    )
    cfg = parse_job_config(demo_data)
    layout = job_layout(cfg)
    assert (layout.num_actor_ranks, layout.num_ranks("sequence_ranks")) == (4, 2)
    problems = find_local_problems(cfg)
    assert [p.path for p in problems] == ([FIELD] if refused else [])
    if refused:  # the demo model's 2 KV heads leave one per TP rank, which Ulysses cannot split
        assert "x tensor_parallel_size 2" in problems[0].message and "num_key_value_heads=2" in problems[0].message


def test_ring_attention_runs_a_cp_size_the_kv_heads_do_not_divide(demo_data):
    demo_data["training"].update(context_parallel_size=4, data_parallel_size=1, context_parallel_mode="ring")
    assert find_local_problems(parse_job_config(demo_data)) == []


def test_an_unknown_cp_mode_names_the_field(demo_data):
    demo_data["training"]["context_parallel_mode"] = "allgather"
    assert "training.context_parallel_mode" in problem_paths(demo_data)
