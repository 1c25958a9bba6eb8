"""The layout-memory benchmark on real gloo ranks at a small length (rldock_benchmarks.layout_memory): one
update step of 4 micro-batches through the FSDP backend at one rank, PP 2 (1F1B), PP 2 x FSDP 2 and FSDP 2 x
TP 2. What holds on any CPU and thread count: each rank's training state is the planner's to the byte (but
AdamW's 4-byte step counters); autograd keeps on stage 0 of PP 2 what one rank keeps for a micro-batch of the
whole model (two micro-batches of half the layers, as 1F1B holds them), on the last stage half of it, and
under TP what the planner's fall says, within 10%; every layout's peak per rank is below one rank's and within
half of the planner's either way. At 128 tokens the peak is mostly the state, gathered weights and the LM head's
chunk; how far the peak's fall is from the planner's at the default 512 tokens is docs/scaling.md's (sections 11
and 12)."""

import pytest

from rldock_benchmarks.layout_memory import LAYOUTS, run_layouts, summarize

pytestmark = pytest.mark.integration

TOKENS, MICRO_BATCHES = 128, 4


@pytest.fixture(scope="module")
def report() -> dict:
    rows = run_layouts(list(LAYOUTS), tokens=TOKENS, micro_batches=MICRO_BATCHES)
    return summarize(rows, tokens=TOKENS, micro_batches=MICRO_BATCHES)


def _ranks(report: dict, layout: str) -> list[dict]:
    return [row for row in report["rows"] if row["layout"] == layout]


def test_each_rank_holds_the_planned_training_state_to_the_byte(report):
    assert {row["layout"] for row in report["rows"]} == set(LAYOUTS)
    for row in report["rows"]:
        assert row["state_bytes"] == row["planned_state_bytes"] + 4 * row["parameter_tensors"], row
    (one,) = _ranks(report, "one_rank")
    for row in _ranks(report, "pp2"):  # half the layers and one vocabulary matrix a stage
        assert row["state_bytes"] == pytest.approx(one["state_bytes"] / 2, rel=0.001)
    for row in _ranks(report, "pp2_fsdp2"):
        assert row["state_bytes"] == pytest.approx(one["state_bytes"] / 4, rel=0.001)


def test_one_forward_one_backward_holds_the_planned_activations(report):
    """Stage 0 of 2 holds min(p - s, m) = 2 micro-batches of its 2 layers, the last stage 1 and the final norm;
    TP splits what the planner says it splits."""
    for layout in ("pp2", "pp2_fsdp2", "fsdp2_tp2"):
        for row in _ranks(report, layout):
            assert abs(row["saved_fall_vs_planned_error"]) <= 0.1, row
    (one,) = _ranks(report, "one_rank")
    h = report["model"]["hidden_size"]  # the final norm: float32 input and root, two h-wide float32 tensors
    final_norm = report["tokens_per_micro_batch"] * (4 * (h + 1) + 2 * h * 4)
    layers = one["planned_saved_bytes"] - final_norm  # one micro-batch through the 4 layers
    for row in _ranks(report, "pp2"):
        assert row["planned_saved_bytes"] == (layers if row["stage"] == 0 else layers // 2 + final_norm)


def test_the_peak_falls_with_each_layout_and_is_the_planners_in_size(report):
    (one,) = _ranks(report, "one_rank")
    for layout in ("pp2", "pp2_fsdp2", "fsdp2_tp2"):
        for row in _ranks(report, layout):
            assert row["peak_bytes"] < one["peak_bytes"], row
    # PP 2 x FSDP 2's peak against PP 2's, stage by stage, is not compared: it holds quiet (stage 0: 41.1 MB against
    # 50.2) but not under load, where FSDP's gathered layers outlive their use longer (50.5 MB, in a fresh clone's
    # CI beside the job tiers). Its state is half PP 2's to the byte (above), which is what FSDP divides.
    for row in report["rows"]:
        assert 0.5 < row["peak_over_planned"] < 1.5, row
