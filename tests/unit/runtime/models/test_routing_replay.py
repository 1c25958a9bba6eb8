"""Routing replay (models/routing_replay.py) on the float64 Qwen3-MoE of the expert-parallel tests (and a float64
DeepSeek-V3, whose sigmoid router weights its experts otherwise): the
record's token grid is the same whatever the passes' layout (padded, trimmed, packed), a replayed pass
routes every real token by the record even after the weights moved (and without replay it does not),
the router still gets a gradient, and with unmoved weights replay changes nothing.

Tolerances: float64 throughout; a replayed pass with unmoved weights runs the very operations of an
ordinary one (the gathered probabilities are the top-k values themselves), so it is compared exactly."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rldock.config.job import JobConfig
from rldock.config.training import TrainingSpec
from rldock.runtime.engines.policy import packing_prompts
from rldock.runtime.engines.policy_passes import batch_logprobs, micro_batch_scores
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.models.moe import record_routing, routers
from rldock.runtime.models.routing_replay import NO_EXPERT, recording_routes, replaying_batch, replaying_routes
from rldock.runtime.training.ddp import DdpBackend
from rldock.runtime.training.policy_objective import job_objective
from rldock.runtime.training.policy_steps import policy_step
from rldock_e2e.moe_fixture import moe_model

PL, SL = 5, 6


def _batch() -> TensorDict:
    """8 rows in GRPO groups of 2 (rows 2i, 2i+1 share a prompt), left-padded prompts, right-padded responses."""
    gen = torch.Generator().manual_seed(3)
    prompt_lengths, response_lengths = [5, 5, 3, 3, 4, 4, 2, 2], [6, 2, 4, 5, 1, 3, 6, 4]
    prompt_ids = torch.zeros(8, PL, dtype=torch.int64)
    prompt_mask = torch.zeros(8, PL, dtype=torch.int64)
    response_ids = torch.zeros(8, SL, dtype=torch.int64)
    response_mask = torch.zeros(8, SL, dtype=torch.int64)
    for row in range(8):
        if row % 2 == 0:
            prompt = torch.randint(1, 64, (prompt_lengths[row],), generator=gen)
        prompt_ids[row, PL - len(prompt) :] = prompt
        prompt_mask[row, PL - len(prompt) :] = 1
        n = response_lengths[row]
        response_ids[row, :n] = torch.randint(1, 64, (n,), generator=gen)
        response_mask[row, :n] = 1
    columns = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids)
    return TensorDict({**columns, "response_mask": response_mask}, batch_size=[8])


def _record(model, batch, training: TrainingSpec) -> torch.Tensor:
    with torch.no_grad(), recording_routes(model, num_rows=len(batch), row_width=PL + SL) as routes:
        batch_logprobs(model, batch, training, routes=routes)
    return routes.routed_experts()  # (B, PL+SL, layers, k)


def _real(batch) -> torch.Tensor:
    return torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).bool()  # (B, PL+SL)


def _sorted(grid: torch.Tensor) -> torch.Tensor:
    return grid.sort(dim=-1).values


def _move_routers(model, seed: int = 7) -> None:
    """Weights that moved: every router redrawn (std 0.5, decisive), so most tokens' top-2 change."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for gate in routers(model):
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen, dtype=gate.weight.dtype) * 0.5)


LAYOUTS = {
    "padded": TrainingSpec(micro_batch_size=8, trim_padding=False),  # one pass, all PL + SL columns
    "trimmed": TrainingSpec(micro_batch_size=1, trim_padding=True),  # a row per pass, its own columns (packing ties)
    "packed": TrainingSpec(micro_batch_size=4, trim_padding=True),  # groups of 2 share a prompt
}


def test_the_record_is_the_same_grid_whatever_the_passes_layout():
    model = moe_model()
    batch = _batch()
    attention = batch["response_mask"]
    for name, packs in [("trimmed", False), ("packed", True)]:  # the layouts are what they say
        training = LAYOUTS[name]
        prompts = packing_prompts(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            attention,
            trim=True,
            micro_batch_size=training.micro_batch_size,
        )
        assert (prompts is not None) == packs, name
    grids = {name: _record(model, batch, training) for name, training in LAYOUTS.items()}
    real = _real(batch)
    assert (grids["padded"][real] != NO_EXPERT).all() and (grids["padded"][~real] == NO_EXPERT).all()
    for name, grid in grids.items():
        assert (grid[~real] == NO_EXPERT).all(), name
        torch.testing.assert_close(_sorted(grid[real]), _sorted(grids["padded"][real]), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_replayed_pass_routes_by_the_record_after_the_weights_moved(layout):
    model = moe_model()
    batch = _batch()
    recorded = _record(model, batch, LAYOUTS["padded"])
    _move_routers(model)
    real = _real(batch)
    # The routing the moved model's passes use, recorded behind the replay's hooks in one padded pass
    # (rows x (PL + SL) tokens in grid order): models/moe.py's record sees what the experts received.
    with replaying_routes(model, recorded) as replay, record_routing(model) as used:
        batch_logprobs(model, batch, LAYOUTS["padded"], routes=replay)
    for layer, indices in enumerate(used.indices[0]):
        grid = indices.reshape(len(batch), PL + SL, -1)
        assert torch.equal(_sorted(grid[real]), _sorted(recorded[real][:, layer].long()))
    assert replay.metrics()["moe/routing_replay_changed"] > 0.3  # the routers moved: replay changed most routes
    # The same replay through the layout under test (trimmed, packed passes): every real token's experts are
    # the record's, so the moved model's record under replay is the original one.
    again = _replayed_record(model, batch, recorded, LAYOUTS[layout])
    torch.testing.assert_close(_sorted(again[real]), _sorted(recorded[real]), rtol=0, atol=0)
    # Without replay the moved routers choose otherwise: what the test above would catch.
    fresh = _record(model, batch, LAYOUTS[layout])
    assert not torch.equal(_sorted(fresh[real]), _sorted(recorded[real]))


def _replayed_record(model, batch, recorded, training) -> torch.Tensor:
    """The grid the moved model's passes route by under replay: a record taken behind the replay."""

    class Both:  # a test double: one begin_pass for the two hook sets
        def __init__(self, *hooks):
            self.hooks = hooks

        def begin_pass(self, cells):
            for hooks in self.hooks:
                hooks.begin_pass(cells)

    with (
        torch.no_grad(),
        replaying_routes(model, recorded) as replay,
        recording_routes(model, num_rows=len(batch), row_width=PL + SL) as record,
    ):
        batch_logprobs(model, batch, training, routes=Both(replay, record))
    return record.routed_experts()


def _deepseek_model():
    """A float64 DeepSeek-V3 (latent attention, a dense first layer, a shared expert) whose sigmoid routers choose
    by a correction bias and weight by their scaled scores, unlike Qwen's softmax (routing_replay.GateScoring)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        rope_scaling=None,
        max_position_embeddings=32,
        experts_implementation="eager",  # the default grouped_mm kernel refuses float64
    )
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).double()
    with torch.no_grad():
        for gate in routers(model):
            gate.weight.normal_(0, 0.5)
            gate.e_score_correction_bias.normal_(0, 0.3)  # chooses apart from the scores that weight
    assert len(routers(model)) == 2  # the first layer is dense
    return model


# DeepSeek-V3's replayed weights are its sigmoid scores of the recorded experts, renormalised and times
# routed_scaling_factor, as it weights its own choice: softmax probabilities would change every pass.
@pytest.mark.parametrize("make_model", [moe_model, _deepseek_model], ids=["qwen3_moe", "deepseek_v3"])
def test_replay_with_unmoved_weights_changes_nothing_and_trains_the_router(make_model):
    model = make_model()
    batch = _batch()
    recorded = _record(model, batch, LAYOUTS["packed"])
    plain = micro_batch_scores(model, batch, LAYOUTS["padded"]).logprobs
    batch[("routed_experts")] = recorded
    with replaying_batch(model, batch) as replay:
        replayed = micro_batch_scores(model, batch, LAYOUTS["padded"], routes=replay).logprobs
    assert replay is not None and replay.metrics()["moe/routing_replay_changed"] == 0.0
    torch.testing.assert_close(replayed, plain, rtol=0, atol=0)
    replayed.sum().backward()
    assert all(gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0 for gate in routers(model))


def test_a_batch_without_the_column_is_not_replayed():
    with replaying_batch(moe_model(), _batch()) as replay:
        assert replay is None


def _step_config(replay: str) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 4,
            "num_responses_per_prompt": 2,
            "max_prompt_length": PL,
            "max_response_length": SL,
            "learning_rate": 1e-3,
            "kl_coef": 0.0,
            "routing_replay": replay,
        },
        training={"micro_batch_size": 4},
    )


@pytest.mark.parametrize("replay", ["off", "reference"])
def test_the_update_step_replays_the_column_and_reports_the_ratio_spread(replay):
    """policy_step on a mini-batch whose old logprobs and routing the unmoved model computed, after the
    routers moved: with the column it routes by it (most routes pinned), and the ratio's spread over the
    sampled tokens is smaller than without (the moved routers' own choices change the logprobs more)."""
    cfg = _step_config(replay)
    model = moe_model()
    batch = _batch()
    recorded = _record(model, batch, LAYOUTS["packed"])
    with torch.no_grad():
        batch["old_logprobs"] = batch_logprobs(model, batch, LAYOUTS["packed"]).float()
    batch["advantage"] = torch.linspace(-1, 1, len(batch), dtype=torch.float64)
    if replay == "reference":
        batch["routed_experts"] = recorded
    batch["sampled_logprobs"] = batch["old_logprobs"]  # as an engine that scored exactly as the old-logprob pass
    _move_routers(model)
    backend = DdpBackend(cfg, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), rank=0, world_size=1)
    stats = policy_step(backend, batch, job_objective(cfg, job_recipe(cfg)), cfg=cfg, world_size=1)
    assert stats["ratio_sq_dev_mean"] > 0 and stats["ratio_abs_dev_max"] > 0 and stats["logprob_abs_diff_mean"] > 0
    assert stats["rollout_logprob_abs_diff_mean"] == pytest.approx(stats["logprob_abs_diff_mean"], rel=1e-6)
    if replay == "off":
        assert "moe/routing_replay_changed" not in stats
        return
    assert stats["moe/routing_replay_changed"] > 0.3
    off = _step_config("off")
    plain = moe_model()
    _move_routers(plain)
    del batch["routed_experts"]
    backend = DdpBackend(off, model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.0), rank=0, world_size=1)
    unreplayed = policy_step(backend, batch, job_objective(off, job_recipe(off)), cfg=off, world_size=1)
    assert stats["ratio_sq_dev_mean"] < unreplayed["ratio_sq_dev_mean"]
    assert stats["logprob_abs_diff_mean"] < unreplayed["logprob_abs_diff_mean"]


def test_a_context_parallel_rank_keeps_the_cells_of_its_own_positions():
    """A pass of 2 rows x 5 positions under CP 2 is padded to 6, rank 1 computing positions 3..5: it keeps
    the cells of positions 3 and 4 of each row, their tokens counted in its own (2, 3) inputs."""
    from rldock.runtime.models.pass_cells import PassCells

    tokens = torch.tensor([0, 1, 3, 4, 5, 8, 9])  # flat (2, 5): row 0 positions 0, 1, 3, 4; row 1 positions 0, 3, 4
    cells = PassCells(cells=torch.arange(100, 107), tokens=tokens)
    mine = cells.on_positions(width=5, local=slice(3, 6))
    assert mine.cells.tolist() == [102, 103, 105, 106]
    assert mine.tokens.tolist() == [0, 1, 3, 4]  # row 0 -> 0, 1; row 1 -> 3 + 0, 3 + 1
