"""The update-cost benchmark's batches and ratios (its runs need SmolLM2 and minutes: not here)."""

from __future__ import annotations

from rldock_benchmarks.update_cost import SHAPES, STEPS, _ratios, make_batch


def test_batches_have_the_shapes_lengths_and_an_unscored_tool_reply():
    for name, shape in SHAPES.items():
        batch = make_batch(shape, vocab_size=100)
        prompts = batch["prompt_mask"].sum(1)
        responses = batch["response_attention_mask"].sum(1)
        assert len(batch) == shape.rows, name
        assert ((prompts >= shape.prompt_lengths[0]) & (prompts <= shape.prompt_lengths[1])).all(), name
        assert ((responses >= shape.response_lengths[0]) & (responses <= shape.response_lengths[1])).all(), name
        assert (batch["prompt_mask"][:, -1] == 1).all()  # left-padded
        assert (batch["response_mask"] <= batch["response_attention_mask"]).all()
        unscored = (batch["response_attention_mask"] - batch["response_mask"]).sum(1)
        assert (unscored > 0).all() if shape.tool_tokens[1] else (unscored == 0).all(), name
        assert (make_batch(shape, vocab_size=100)["prompt_ids"] == batch["prompt_ids"]).all()  # seeded


def test_ratios_are_against_the_same_shapes_before_step():
    def result(shape, step, seconds, cpu, peak):
        return {
            "shape": shape,
            "step": step,
            "seconds_per_update": seconds,
            "cpu_seconds_per_update": cpu,
            "update_peak_mib": peak,
        }

    results = [
        result("tool", "before", 10.0, 8.0, 1000),
        result("tool", "chunked_head", 5.0, 6.0, 400),
        result("smollm2", "before", 2.0, 2.0, 100),
        result("smollm2", "token_budget", 1.0, 1.5, 50),
        {"shape": "tool_warmup", "step": "token_budget", "peak_rss_mib": 3000},
    ]
    ratios = _ratios(results)
    assert ratios["tool/chunked_head"] == {"seconds": 0.5, "cpu_seconds": 0.75, "update_peak": 0.4}
    assert ratios["smollm2/token_budget"] == {"seconds": 0.5, "cpu_seconds": 0.75, "update_peak": 0.5}
    assert ratios["tool/before"]["seconds"] == 1.0 and "tool_warmup/token_budget" not in ratios
    assert STEPS[0] == "before"


def test_a_groups_rows_share_their_prompt_and_the_warmups_do_not():
    from rldock.runtime.engines.packing import prompt_groups

    for name, shape in SHAPES.items():
        batch = make_batch(shape, vocab_size=100)
        groups = prompt_groups(batch["prompt_ids"], batch["prompt_mask"]).tolist()
        assert groups == [row // shape.responses_per_prompt for row in range(shape.rows)], name
        single = make_batch(shape, vocab_size=100, group_size=1)
        assert prompt_groups(single["prompt_ids"], single["prompt_mask"]).tolist() == list(range(shape.rows)), name
