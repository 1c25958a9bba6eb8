"""The FSDP vs DDP benchmark's report: ratios, loss agreement and the planner's figure beside it."""

from rldock_benchmarks.fsdp_vs_ddp import DEFAULT_SHAPE, LOSS_RTOL, parse_args, planned_state_bytes, summarize


def _rank(state: int, losses: list[float], step_s: list[float]) -> dict:
    return {
        "state_bytes": {"train_params": state // 4, "grads": state // 4, "optimizer_state": state // 2},
        "losses": losses,
        "step_s": step_s,
    }


def test_report_ratios_and_loss_agreement():
    args = parse_args(["--steps", "3"])
    results = {
        "ddp": [_rank(1600, [3.0, 2.0, 1.0], [9.0, 2.0, 2.0])] * 2,
        "fsdp": [_rank(800, [3.0, 2.0, 1.0 + LOSS_RTOL / 2], [9.0, 3.0, 3.0])] * 2,
    }
    report = summarize(args, results)
    assert report["state_ratio_fsdp_over_ddp"] == 0.5
    assert report["losses_equal"] and report["max_loss_rel_diff"] <= LOSS_RTOL
    assert report["step_time_ratio_fsdp_over_ddp"] == 1.5  # the first (warm-up) step is left out
    results["fsdp"] = [_rank(800, [3.0, 2.0, 1.1], [1.0, 1.0, 1.0])] * 2
    assert not summarize(args, results)["losses_equal"]


def test_planned_bytes_are_the_planners_params_grads_and_adamw():
    params = DEFAULT_SHAPE["vocab_size"] * 768 + 12 * (768 * 768 * 2 + 2 * 768 * 256 + 3 * 768 * 2048 + 2 * 768) + 768
    args = parse_args([])
    assert planned_state_bytes(args, "ddp") == 16 * params
    assert planned_state_bytes(args, "fsdp") == 8 * params
