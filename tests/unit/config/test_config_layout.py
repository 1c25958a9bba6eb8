"""A JobConfig's layout (rldock.config.job_layout): the sizes read from the config once, and the
device groups the config counts (a reference per DP rank of each pipeline stage unless LoRA, a critic per
DP rank for the algorithms with one, a reward model for a `model` term)."""

from __future__ import annotations

import pytest
from job_examples import example

from rldock.config import parse_job_config
from rldock.config.job_layout import job_layout
from rldock.contract.layout import DeviceGroup

REFERENCE = DeviceGroup("reference", "stage_sequence_ranks")
CRITIC = DeviceGroup("critic", "stage_sequence_ranks", distinct=True)
REWARD_MODEL = DeviceGroup("reward_model")
MODEL_TERMS = {"terms": [{"name": "model", "path": "/rm"}, {"name": "digit_match"}]}


def _cfg(*, algorithm=None, training=None, rollout=None, resources=None, reward=None):
    data = example()
    for name, section in (
        ("algorithm", algorithm),
        ("training", training),
        ("rollout", rollout),
        ("resources", resources),
        ("reward", reward),
    ):
        if section:
            data[name] = {**data.get(name, {}), **section}
    return parse_job_config(data)


# (the config's sections) -> (dp, tp, generation_tp, groups, devices needed)
LAYOUTS = [
    ({}, (2, 1, 1, (REFERENCE,), 2)),  # the demo: 2 actor ranks, a reference beside each
    ({"resources": {"placement": "separate"}}, (2, 1, 1, (REFERENCE,), 4)),
    ({"training": {"lora": {"rank": 4}}}, (2, 1, 1, (), 2)),  # the actor ranks run the reference pass
    ({"algorithm": {"name": "ppo"}}, (2, 1, 1, (REFERENCE, CRITIC), 4)),
    ({"algorithm": {"name": "ppo"}, "resources": {"placement": "separate"}}, (2, 1, 1, (REFERENCE, CRITIC), 6)),
    ({"reward": MODEL_TERMS}, (2, 1, 1, (REFERENCE, REWARD_MODEL), 3)),
    (
        {"training": {"data_parallel_size": 1, "tensor_parallel_size": 4}, "rollout": {"tensor_parallel_size": 2}},
        (1, 4, 2, (REFERENCE,), 4),
    ),
    (
        {"algorithm": {"name": "ppo"}, "training": {"data_parallel_size": 2, "tensor_parallel_size": 2}},
        (2, 2, 1, (REFERENCE, CRITIC), 4),  # the critics fill the halves the references left
    ),
]


def test_the_reference_runs_a_rank_per_stage_and_sequence_rank_in_a_group_of_its_own():
    # PP 2 x DP 2: 4 actor ranks, and a reference rank beside each (its stages pass activations on)
    layout = job_layout(_cfg(training={"strategy": "fsdp", "pipeline_parallel_size": 2}))
    assert layout.groups == (DeviceGroup("reference", "stage_sequence_ranks", distinct=True),)
    assert (layout.num_actor_ranks, layout.group_ranks("reference")) == (4, 4)
    assert [layout.seats_on(device) for device in range(4)] == [[f"actor {r}", f"reference {r}"] for r in range(4)]
    # under TP it runs without TP: PP 2 x DP 1 x TP 2 seats 2 reference ranks
    tp = job_layout(
        _cfg(
            training={
                "strategy": "fsdp",
                "pipeline_parallel_size": 2,
                "data_parallel_size": 1,
                "tensor_parallel_size": 2,
            }
        )
    )
    assert (tp.num_actor_ranks, tp.group_ranks("reference")) == (4, 2)


@pytest.mark.parametrize(("sections", "expected"), LAYOUTS)
def test_the_layout_reads_the_sizes_and_counts_the_groups(sections, expected):
    cfg = _cfg(**sections)
    layout = job_layout(cfg)
    assert (layout.dp, layout.tp, layout.generation_tp, layout.groups, layout.num_devices_needed) == expected
    assert (layout.num_nodes, layout.devices_per_node, layout.accelerator) == (1, 8, "NPU")
    assert layout.placement == cfg.resources.placement
    assert layout.num_actor_ranks == cfg.training.data_parallel_size * cfg.training.tensor_parallel_size


def test_named_groups_replace_the_configs_count():
    # the runtime seats the groups its worker-state specs name, e.g. none with kl_coef 0
    layout = job_layout(_cfg(), groups=[DeviceGroup("toy", "actor_ranks")])
    assert layout.groups == (DeviceGroup("toy", "actor_ranks"),)
    assert layout.seats_on(0) == ["actor 0", "toy 0"] and layout.num_devices_needed == 2


def test_the_planners_one_dp_rank_override():
    layout = job_layout(_cfg(algorithm={"name": "ppo"}, training={"data_parallel_size": 4}))
    one = layout.with_data_parallel_size(1)
    assert (layout.num_devices_needed, one.num_devices_needed) == (8, 2)
    assert one.seats_on(1) == ["critic 0"]
