"""The train-inference mismatch correction (algorithms/rollout_correction.py) against independent
references: each peer's formula as its docs state it, written as plain Python loops over float64
lists, on seeded random logprobs with responses of several lengths, padding and an all-padding row.

Tolerances. Both sides start from the same float32 inputs, exact in float64, and form each token's log
ratio with the same IEEE subtraction. A sequence's log ratio is then a float64 sum of T <= 40 addends
in some order: |error| <= (T-1) 2^-53 sum|x| < 1e-13 here, so exp() of it is off by a relative 1e-13
plus an ulp or two of float64 (the reference's product of T ratios likewise: (3T/2) 2^-53 < 1e-14).
The weight is returned in float32, rounded to nearest: a relative 2^-24. Every weight is therefore
within 2^-24 + 1e-12 < 2^-23 of the reference, and RTOL = 2^-22 holds with twofold headroom on any CPU
and thread count (no float32 accumulation happens, so the error does not grow with T). The metrics are
float64 to the end and are held to the bound of a float64 sum in any order, gamma_n sum|v| with gamma_n
= 2n 2^-53, plus a few ulps of each term (see _sum_tol).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pytest
import torch

from rldock.config.rollout_correction import PRESETS, RolloutCorrectionSpec
from rldock.runtime.algorithms.rollout_correction import (
    correction_weight,
    merge_mismatch,
    mismatch_metrics,
    mismatch_part,
    rejection_mask,
)

RTOL = 2.0**-22
LENGTHS = [1, 5, 17, 40, 0, 33, 40, 26]  # valid tokens per response; the 0 is an all-padding row
T = 40


def _preset(name: str) -> dict:
    """The preset's correction_weight arguments, as a job config with it set gives them."""
    return RolloutCorrectionSpec(preset=name).arguments()


def _batch(seed: int = 0, noise: float = 0.15, outliers: float = 2.0) -> tuple[torch.Tensor, ...]:
    """trainer, engine (B, T) float32 logprobs and mask (B, T): the engine's logprob is the trainer's
    plus N(0, noise) per token, and a few tokens are off by +-`outliers` (the cases a band rejects)."""
    g = torch.Generator().manual_seed(seed)
    b = len(LENGTHS)
    trainer = -5.0 * torch.rand(b, T, generator=g)
    gap = noise * torch.randn(b, T, generator=g)
    pick = torch.rand(b, T, generator=g)
    gap = torch.where(pick < 0.04, gap + outliers, torch.where(pick > 0.96, gap - outliers, gap))
    engine = trainer - gap
    mask = torch.zeros(b, T)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1.0
    return trainer, engine, mask


def _log_ratios(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """Each response's valid tokens' log ratios, as Python floats (the same IEEE subtraction)."""
    out = []
    for t_row, e_row, m_row in zip(trainer.tolist(), engine.tolist(), mask.tolist()):
        out.append([t - e for t, e, m in zip(t_row, e_row, m_row) if m != 0])
    return out


def _prod(values: Iterable[float]) -> float:
    p = 1.0
    for v in values:
        p *= v
    return p


def _padded(rows: list[list[float]]) -> torch.Tensor:
    """(B, T) float64 from per-response values of the valid tokens, 0 on padding."""
    return torch.tensor([row + [0.0] * (T - len(row)) for row in rows], dtype=torch.float64)


def _assert_weights(actual: torch.Tensor, expected: list[list[float]]) -> None:
    assert actual.dtype == torch.float32 and actual.shape == (len(LENGTHS), T)
    torch.testing.assert_close(actual.to(torch.float64), _padded(expected), rtol=RTOL, atol=0.0)


def _assert_clear_of(values: list[float], bounds: list[float]) -> None:
    """The data decide every keep/reject well away from a bound, so rounding cannot flip a decision."""
    for v in values:
        for b in bounds:
            if 0 < b < math.inf:
                assert abs(v - b) > 1e-9 * b, (v, b)


# --- TRL: GRPOTrainer's vllm_importance_sampling_* (docs: grpo_trainer.md, paper_index.md) -----------


def _trl(rows: list[list[float]], mode: str, c_min: float | None, c_max: float | None) -> list[list[float]]:
    """rho per token, or rho_seq = prod_t rho_t on every token for sequence_*; *_truncate clips rho to
    [C_min, C_max]; *_mask sets rho to 0 outside [C_min, C_max] (a None bound is open)."""
    lo = -math.inf if c_min is None else c_min
    hi = math.inf if c_max is None else c_max
    out = []
    for row in rows:
        ratios = [math.exp(x) for x in row]
        if mode.startswith("sequence"):
            seq = _prod(ratios)
            ratios = [seq] * len(row)
        if mode.endswith("truncate"):
            out.append([min(max(r, lo), hi) for r in ratios])
        else:
            out.append([r if lo <= r <= hi else 0.0 for r in ratios])
    return out


def _trl_kwargs(mode: str, c_min: float | None, c_max: float | None) -> dict:
    """The module docstring's mapping of a TRL mode onto correction_weight's arguments."""
    level, kind = mode.split("_")
    low = 0.0 if c_min is None else c_min
    high = math.inf if c_max is None else c_max
    reject = "none" if kind == "truncate" else level
    return {"weight": level, "cap": high, "reject": reject, "low": low, "high": high}


@pytest.mark.parametrize(
    ("mode", "c_min", "c_max"),
    [
        ("token_truncate", None, 2.0),
        ("sequence_truncate", None, 3.0),
        ("token_mask", None, 3.0),
        ("token_mask", 0.5, 2.0),
        ("sequence_mask", None, 3.0),
        ("sequence_mask", 0.5, 2.0),
        ("sequence_mask", 0.5, None),
    ],
)
def test_equals_trls_vllm_importance_sampling_modes(mode, c_min, c_max):
    trainer, engine, mask = _batch()
    rows = _log_ratios(trainer, engine, mask)
    bounds = [b for b in (c_min, c_max) if b is not None]
    _assert_clear_of([math.exp(x) for row in rows for x in row] + [_prod(map(math.exp, r)) for r in rows], bounds)
    expected = _trl(rows, mode, c_min, c_max)
    _assert_weights(correction_weight(trainer, engine, mask, **_trl_kwargs(mode, c_min, c_max)), expected)


def test_the_trl_preset_is_trls_default_sequence_mask_and_drops_some_sequences():
    trainer, engine, mask = _batch()
    rows = _log_ratios(trainer, engine, mask)
    expected = _trl(rows, "sequence_mask", None, 3.0)  # GRPOConfig's defaults
    _assert_weights(correction_weight(trainer, engine, mask, **_preset("trl")), expected)
    dropped = [row for row in expected if row and all(w == 0 for w in row)]
    kept = [row for row in expected if row and all(w > 0 for w in row)]
    assert dropped and kept  # the data exercise both sides of the mask


# --- verl: rollout_is / rollout_rs (docs/algo/rollout_corr.md, rollout_corr_math.md) ------------------


def _verl_is(rows: list[list[float]], level: str, threshold: float) -> list[list[float]]:
    """Token: exp(clamp(log rho_t, -20, 20)); sequence: exp(clamp(sum log rho_t, -20, 20)) on every token;
    then .clamp(max=rollout_is_threshold), no lower truncation."""
    out = []
    for row in rows:
        if level == "token":
            out.append([min(math.exp(min(max(x, -20.0), 20.0)), threshold) for x in row])
        else:
            total = sum(row)
            assert -20.0 < total < 20.0  # verl's safety clamp does not bind on this data
            out.append([min(_prod(math.exp(x) for x in row), threshold)] * len(row))
    return out


def _verl_rs(rows: list[list[float]], level: str, lower: float, upper: float) -> list[list[float]]:
    """Keep (1) where the token's ratio, the sequence's product or its geometric mean prod^(1/n) is in
    [lower, upper], bounds inclusive; 0 rejects the token from response_mask."""
    out = []
    for row in rows:
        ratios = [math.exp(x) for x in row]
        if level == "token":
            out.append([1.0 if lower <= r <= upper else 0.0 for r in ratios])
            continue
        stat = _prod(ratios)
        if level == "geometric" and row:
            stat = stat ** (1.0 / len(row))
        out.append([1.0 if lower <= stat <= upper else 0.0] * len(row))
    return out


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_equals_verls_truncated_importance_weights(level):
    trainer, engine, mask = _batch()
    rows = _log_ratios(trainer, engine, mask)
    weights = correction_weight(trainer, engine, mask, weight=level, cap=2.0, reject="none", low=0.0, high=math.inf)
    _assert_weights(weights, _verl_is(rows, level, 2.0))


@pytest.mark.parametrize(
    ("level", "lower", "upper"), [("token", 0.5, 2.0), ("sequence", 0.5, 2.0), ("geometric", 0.9, 1.1)]
)
def test_equals_verls_rejection_sampling(level, lower, upper):
    trainer, engine, mask = _batch()
    rows = _log_ratios(trainer, engine, mask)
    stats = [math.exp(x) for row in rows for x in row] + [_prod(map(math.exp, r)) for r in rows]
    stats += [_prod(map(math.exp, r)) ** (1 / len(r)) for r in rows if r]
    _assert_clear_of(stats, [lower, upper])
    keep = _verl_rs(rows, level, lower, upper)
    assert any(0.0 in row for row in keep) and any(1.0 in row for row in keep)
    kept = rejection_mask(trainer, engine, mask, reject=level, low=lower, high=upper)
    assert kept.dtype == torch.float32
    assert kept.to(torch.float64).equal(_padded(keep))  # verl's modified response_mask
    # rejection alone: the factor is the keep mask; with Seq-TIS: verl's IS weight times it
    alone = correction_weight(trainer, engine, mask, weight="none", cap=math.inf, reject=level, low=lower, high=upper)
    assert alone.to(torch.float64).equal(_padded(keep))
    both = correction_weight(trainer, engine, mask, weight="sequence", cap=2.0, reject=level, low=lower, high=upper)
    is_weights = _verl_is(rows, "sequence", 2.0)
    _assert_weights(both, [[w * k for w, k in zip(wr, kr)] for wr, kr in zip(is_weights, keep)])


def test_the_verl_presets_are_seq_tis_seq_mis_and_geo_rs():
    trainer, engine, mask = _batch()
    rows = _log_ratios(trainer, engine, mask)
    _assert_weights(correction_weight(trainer, engine, mask, **_preset("verl")), _verl_is(rows, "sequence", 2.0))
    seq_mis = [
        [w * k for w, k in zip(wr, kr)]
        for wr, kr in zip(_verl_is(rows, "sequence", 2.0), _verl_rs(rows, "sequence", 0.5, 2.0))
    ]
    _assert_weights(correction_weight(trainer, engine, mask, **_preset("verl_seq_mis")), seq_mis)
    # Geo-RS, verl >= 0.7: seq_mean_k1 keeps log(0.999) <= mean(-log rho_t) <= log(1.001); a tight band,
    # so a batch with a tight gap (and no outliers) has responses on both sides of it
    trainer, engine, mask = _batch(seed=1, noise=0.004, outliers=0.0)
    rows = _log_ratios(trainer, engine, mask)
    k1 = [-sum(r) / len(r) for r in rows if r]
    _assert_clear_of([math.exp(v) for v in k1], [0.999, 1.001])
    expected = [
        [1.0 if math.log(0.999) <= -sum(r) / len(r) <= math.log(1.001) else 0.0] * len(r) if r else [] for r in rows
    ]
    assert any(row and 0.0 not in row for row in expected) and any(0.0 in row for row in expected)
    _assert_weights(correction_weight(trainer, engine, mask, **_preset("verl_geo_rs")), expected)


# --- IcePop: M(k) = k on [alpha, beta], 0 outside, per token ------------------------------------------


def test_icepop_band():
    trainer, engine, mask = _batch()
    rows = _log_ratios(trainer, engine, mask)
    alpha, beta = _preset("icepop")["low"], _preset("icepop")["high"]
    _assert_clear_of([math.exp(x) for row in rows for x in row], [alpha, beta])
    expected = [[math.exp(x) if alpha <= math.exp(x) <= beta else 0.0 for x in row] for row in rows]
    assert any(w == 0.0 for row in expected for w in row)  # the outliers leave the band
    _assert_weights(correction_weight(trainer, engine, mask, **_preset("icepop")), expected)
    # and the same as TRL's token_mask with both bounds
    assert _trl(rows, "token_mask", alpha, beta) == expected


# --- edge cases -----------------------------------------------------------------------------------


def test_a_product_past_float32_range_gives_the_cap_not_inf():
    trainer = torch.zeros(2, 200)
    engine = torch.full((2, 200), -1.0)  # 200 log ratios of 1.0: rho_seq = e^200, past float32's e^88.7
    mask = torch.ones(2, 200)
    mask[1, 100:] = 0
    truncated = correction_weight(trainer, engine, mask, weight="sequence", cap=2.0, reject="none", low=0, high=1)
    assert truncated[0].tolist() == [2.0] * 200 and truncated[1].tolist() == [2.0] * 100 + [0.0] * 100
    rejected = correction_weight(trainer, engine, mask, **_preset("trl"))
    assert rejected.eq(0).all()
    uncapped = correction_weight(trainer, engine, mask, weight="sequence", cap=math.inf, reject="none", low=0, high=1)
    assert torch.isfinite(uncapped).all() and uncapped[0, 0] == torch.finfo(torch.float32).max
    metrics = mismatch_metrics(trainer, engine, mask, rejected)
    assert all(math.isfinite(v) for v in metrics.values())
    # log rho_seq are 200 and 100: the quantiles interpolate between them in log space
    assert metrics["mismatch/seq_ratio_p50"] == pytest.approx(math.exp(150.0), rel=1e-12)
    assert metrics["mismatch/seq_ratio_p99"] == pytest.approx(math.exp(199.0), rel=1e-12)
    assert metrics["mismatch/sequences_dropped"] == 1.0


def test_padding_gives_zero_whatever_it_holds():
    trainer, engine, mask = _batch()
    dirty_t, dirty_e = trainer.clone(), engine.clone()
    dirty_t[mask == 0] = float("nan")
    dirty_e[mask == 0] = float("-inf")
    for kwargs in map(_preset, PRESETS):
        clean = correction_weight(trainer, engine, mask, **kwargs)
        dirty = correction_weight(dirty_t, dirty_e, mask, **kwargs)
        assert dirty.equal(clean) and dirty[mask == 0].eq(0).all()
    assert mismatch_metrics(dirty_t, dirty_e, mask, clean) == mismatch_metrics(trainer, engine, mask, clean)


def test_identical_logprobs_have_no_mismatch():
    trainer, _, mask = _batch()
    for kwargs in map(_preset, PRESETS):
        weight = correction_weight(trainer, trainer, mask, **kwargs)
        assert weight.equal(mask)  # every ratio is 1: kept, and truncation never binds
    metrics = mismatch_metrics(trainer, trainer.clone(), mask, mask)
    assert metrics == {
        "mismatch/kl": 0.0,
        "mismatch/kl_seq": 0.0,
        "mismatch/abs_diff_mean": 0.0,
        "mismatch/abs_diff_max": 0.0,
        "mismatch/seq_ratio_p50": 1.0,
        "mismatch/seq_ratio_p99": 1.0,
        "mismatch/tokens_weighed_down": 0.0,
        "mismatch/tokens_dropped": 0.0,
        "mismatch/sequences_dropped": 0.0,
        "mismatch/tokens": int(mask.sum()),
    }


def test_k3_is_nonnegative_token_by_token_even_next_to_a_ratio_of_one():
    gaps = [s * 10.0**-e for e in range(1, 17) for s in (1.0, -1.0, 3.7, -3.7)] + [5.0, -5.0, 30.0, -30.0]
    for gap in gaps:
        trainer = torch.tensor([[-1.0]], dtype=torch.float64)
        metrics = mismatch_metrics(trainer, trainer - gap, torch.ones(1, 1))
        assert metrics["mismatch/kl"] >= 0.0 and metrics["mismatch/kl_seq"] >= 0.0
        x = (trainer - (trainer - gap)).item()
        assert metrics["mismatch/kl"] == pytest.approx(math.expm1(x) - x, rel=1e-12, abs=2.0**-50 * abs(x))


def test_an_empty_mask_gives_zeros():
    trainer, engine, _ = _batch()
    empty = torch.zeros_like(trainer)
    assert set(mismatch_metrics(trainer, engine, empty).values()) == {0.0}
    metrics = mismatch_metrics(trainer, engine, empty, torch.zeros_like(trainer))
    assert len(metrics) == 10 and set(metrics.values()) == {0.0}
    assert metrics["mismatch/tokens"] == 0  # no token measured, told apart from a gap of 0
    for kwargs in map(_preset, PRESETS):
        assert correction_weight(trainer, engine, empty, **kwargs).eq(0).all()


# --- metrics against the reference ----------------------------------------------------------------


def _sum_tol(terms: list[float], per_term: float = 0.0) -> float:
    """Bound on |float64 sum in any order - exact sum|: gamma_n sum|v| (gamma_n = 2n 2^-53), plus each
    term's own error `per_term`, times n."""
    return 2 * len(terms) * 2.0**-53 * sum(abs(v) for v in terms) + len(terms) * per_term


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics at position q (n - 1)."""
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


@pytest.mark.parametrize("preset", ["trl", "verl", "icepop", "verl_seq_mis"])
def test_metrics_equal_the_reference(preset):
    trainer, engine, mask = _batch()
    rows = _log_ratios(trainer, engine, mask)
    weight = correction_weight(trainer, engine, mask, **_preset(preset))
    metrics = mismatch_metrics(trainer, engine, mask, weight)
    names = ["kl", "kl_seq", "abs_diff_mean", "abs_diff_max", "seq_ratio_p50", "seq_ratio_p99"]
    names += ["tokens_weighed_down", "tokens_dropped", "sequences_dropped", "tokens"]
    assert set(metrics) == {f"mismatch/{k}" for k in names}
    flat = [x for row in rows for x in row]
    seqs = [row for row in rows if row]
    n = len(flat)
    # k3's own error: expm1(x) and the difference, a few ulps of |x| + |expm1(x)|
    k3 = [math.expm1(x) - x for x in flat]
    ulps = 4 * 2.0**-53 * max(abs(x) + abs(math.expm1(x)) for x in flat)
    assert metrics["mismatch/kl"] == pytest.approx(sum(k3) / n, rel=0, abs=_sum_tol(k3, ulps) / n)
    kl_seq = [sum(math.expm1(x) - x for x in row) for row in seqs]
    assert metrics["mismatch/kl_seq"] == pytest.approx(
        sum(kl_seq) / len(seqs), rel=0, abs=(_sum_tol(k3, ulps) + _sum_tol(kl_seq)) / len(seqs)
    )
    absdiff = [abs(x) for x in flat]
    assert metrics["mismatch/abs_diff_mean"] == pytest.approx(sum(absdiff) / n, rel=0, abs=_sum_tol(absdiff) / n)
    assert metrics["mismatch/abs_diff_max"] == max(absdiff)  # the same subtraction, no rounding after it
    seq_logs = [sum(row) for row in seqs]
    # log rho_seq off by at most the longest response's sum bound; interpolation adds a few ulps of it
    log_tol = max(_sum_tol(row) for row in seqs) + 8 * 2.0**-53 * max(abs(v) for v in seq_logs)
    for q, key in ((0.5, "seq_ratio_p50"), (0.99, "seq_ratio_p99")):
        expected = math.exp(_quantile(seq_logs, q))
        assert metrics[f"mismatch/{key}"] == pytest.approx(expected, rel=2 * log_tol + 2.0**-50, abs=0)
    # the shares: counts over counts, with the same decisions (no ratio sits at a bound here)
    w_rows = [[w for w, m in zip(wr, mr) if m != 0] for wr, mr in zip(weight.tolist(), mask.tolist())]
    pairs = [(w, math.exp(x)) for wr, row in zip(w_rows, rows) for w, x in zip(wr, row)]
    assert metrics["mismatch/tokens_weighed_down"] == sum(0 < w < r * (1 - 1e-5) for w, r in pairs) / n
    assert metrics["mismatch/tokens_dropped"] == sum(w == 0 for w, _ in pairs) / n
    dropped = sum(all(w == 0 for w in wr) for wr in w_rows if wr)
    assert metrics["mismatch/sequences_dropped"] == dropped / len(seqs)


def test_the_shares_count_what_the_presets_do():
    trainer, engine, mask = _batch()
    truncated = mismatch_metrics(trainer, engine, mask, correction_weight(trainer, engine, mask, **_preset("verl")))
    assert truncated["mismatch/tokens_dropped"] == 0.0 and truncated["mismatch/tokens_weighed_down"] > 0.0
    masked = mismatch_metrics(trainer, engine, mask, correction_weight(trainer, engine, mask, **_preset("trl")))
    assert masked["mismatch/sequences_dropped"] > 0.0 and masked["mismatch/tokens_dropped"] > 0.0
    icepop = mismatch_metrics(trainer, engine, mask, correction_weight(trainer, engine, mask, **_preset("icepop")))
    assert 0.0 < icepop["mismatch/tokens_dropped"] < 0.2 and icepop["mismatch/sequences_dropped"] < 1.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"weight": "tokens", "cap": 2.0, "reject": "none", "low": 0.0, "high": 1.0},
        {"weight": "token", "cap": 0.0, "reject": "none", "low": 0.0, "high": 1.0},
        {"weight": "token", "cap": 2.0, "reject": "seq", "low": 0.0, "high": 1.0},
        {"weight": "token", "cap": 2.0, "reject": "token", "low": 2.0, "high": 1.0},
        {"weight": "token", "cap": 2.0, "reject": "token", "low": -1.0, "high": 1.0},
    ],
)
def test_invalid_arguments_are_refused(kwargs):
    trainer, engine, mask = _batch()
    with pytest.raises(ValueError):
        correction_weight(trainer, engine, mask, **kwargs)


def test_shapes_must_agree():
    trainer, engine, mask = _batch()
    with pytest.raises(ValueError):
        correction_weight(trainer, engine[:, :-1], mask, **_preset("trl"))
    with pytest.raises(ValueError):
        mismatch_metrics(trainer, engine, mask, torch.ones(2, 2))


def test_the_parts_of_a_split_batch_merge_to_the_whole_batch_s_metrics():
    """Ranks and batches each send a part; merged, they give the metrics of the batch they split."""
    trainer, engine, mask = _batch(seed=3)
    weight = correction_weight(trainer, engine, mask, **_preset("trl"))
    whole = mismatch_metrics(trainer, engine, mask, weight)
    rows = (slice(0, 3), slice(3, 5), slice(5, None))
    merged = merge_mismatch([mismatch_part(trainer[r], engine[r], mask[r], weight[r]) for r in rows])
    assert merged.keys() == whole.keys()
    # float64 sums of at most 320 terms regrouped: relative differences of a few 1e-16 per term
    for key, value in whole.items():
        assert merged[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert merge_mismatch([]) == {
        **{
            f"mismatch/{k}": 0.0
            for k in ("kl", "kl_seq", "abs_diff_mean", "abs_diff_max", "seq_ratio_p50", "seq_ratio_p99")
        },
        "mismatch/tokens": 0,
    }
