"""`algorithm.rollout_correction`: correcting the train-inference mismatch (docs/algorithms/rollout-correction.md).

The engine samples each token and reports its logprob; the old-logprob pass recomputes it in the
trainer. Their ratio rho_t = pi_train / pi_engine weights (truncated importance sampling) or rejects
(masking) the update's tokens: rldock.runtime.algorithms.rollout_correction holds the math and how each
peer's setting maps onto these fields. A preset fills the fields with a peer's setting; a field set
beside it overrides that one field.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from rldock.config.problem import Problem
from rldock.config.section import Spec

if TYPE_CHECKING:  # the section's checks read the whole config, which composes this section
    from rldock.config.job import JobConfig

CorrectionPreset = Literal["trl", "trl_token_truncate", "verl", "verl_seq_mis", "verl_geo_rs", "icepop"]

# Each preset's fields (rldock.runtime.algorithms.rollout_correction's docstring gives the sources).
PRESETS: dict[str, dict[str, object]] = {
    # TRL's GRPOConfig defaults: vllm_importance_sampling_mode sequence_mask, clip_max 3.0, clip_min None
    "trl": {"weight": "sequence", "weight_cap": 3.0, "reject": "sequence", "reject_low": 0.0, "reject_high": 3.0},
    # TRL v0.23-v0.25, before the modes: token truncation at vllm_importance_sampling_cap 2.0
    "trl_token_truncate": {"weight": "token", "weight_cap": 2.0, "reject": "none"},
    # verl's RolloutCorrectionConfig default, decoupled_seq_is (Seq-TIS): rollout_is sequence, threshold 2.0
    "verl": {"weight": "sequence", "weight_cap": 2.0, "reject": "none"},
    # verl's decoupled_seq_is_rs (Seq-MIS): Seq-TIS 2.0 and sequence rejection outside [0.5, 2.0]
    "verl_seq_mis": {
        "weight": "sequence",
        "weight_cap": 2.0,
        "reject": "sequence",
        "reject_low": 0.5,
        "reject_high": 2.0,
    },
    # verl's decoupled_geo_rs (Geo-RS): no weight, the geometric mean kept in [1/1.001, 1/0.999]
    "verl_geo_rs": {"weight": "none", "reject": "geometric", "reject_low": 1 / 1.001, "reject_high": 1 / 0.999},
    # IcePop: a token's gradient dropped outside [0.5, 5.0], rho_t kept inside
    "icepop": {"weight": "token", "weight_cap": 5.0, "reject": "token", "reject_low": 0.5, "reject_high": 5.0},
}


class RolloutCorrectionSpec(Spec):
    """How the update corrects for the engine's logprobs differing from the trainer's."""

    preset: CorrectionPreset | None = Field(
        default=None,
        description="A peer's setting for the fields below: `trl` (TRL's GRPOTrainer default: sequence_mask, "
        "cap 3), `trl_token_truncate` (TRL before its modes: token TIS at 2), `verl` (verl's default Seq-TIS at "
        "2), `verl_seq_mis` (Seq-TIS 2 with sequences outside [0.5, 2] rejected), `verl_geo_rs` (sequences whose "
        "geometric-mean ratio leaves [1/1.001, 1/0.999] rejected), `icepop` (tokens outside [0.5, 5] rejected). "
        "A field set beside it overrides the preset's.",
    )
    weight: Literal["none", "token", "sequence"] = Field(
        default="none",
        description="The importance weight on each token's advantage: `token` min(rho_t, weight_cap) (TIS), "
        "`sequence` min(prod_t rho_t, weight_cap) on all of a response's tokens, `none` 1. rho_t = "
        "pi_train(y_t) / pi_engine(y_t), the trainer's old logprob against the engine's.",
    )
    weight_cap: float = Field(default=2.0, gt=1, le=1e6, description="The largest importance weight.")
    reject: Literal["none", "token", "sequence", "geometric"] = Field(
        default="none",
        description="Which tokens get no gradient (their weight 0; they stay in the loss's token count): `token` "
        "those whose rho_t leaves [reject_low, reject_high] (IcePop), `sequence` every token of a response whose "
        "prod_t rho_t leaves it, `geometric` every token of a response whose exp(mean_t log rho_t) leaves it.",
    )
    reject_low: float = Field(default=0.0, ge=0, description="The band's lower bound (inclusive).")
    reject_high: float | None = Field(
        default=None, gt=0, description="The band's upper bound (inclusive); unset: no upper bound."
    )

    @model_validator(mode="before")
    @classmethod
    def _preset_fields(cls, data: object) -> object:
        """The preset's fields under the ones set beside it (the operator's resolved config writes every
        field, the preset's included, so resolving twice gives the same)."""
        if isinstance(data, dict) and data.get("preset") in PRESETS:
            return {**PRESETS[data["preset"]], **data}
        return data

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments of rldock.runtime.algorithms.rollout_correction.correction_weight."""
        return {
            "weight": self.weight,
            "cap": self.weight_cap,
            "reject": self.reject,
            "low": self.reject_low,
            "high": math.inf if self.reject_high is None else self.reject_high,
        }


def problems(cfg: JobConfig) -> list[Problem]:
    """algorithm.rollout_correction: a correction that does something, bounds that are read; the
    correction monitoring.mismatch's `correct` switches on; and, for it and monitoring.mismatch alike,
    the rollouts and losses the measure is built for (one policy version's engine logprobs per response,
    a per-token advantage)."""
    correction = cfg.algorithm.rollout_correction
    found: list[Problem] = []
    if correction is not None:
        field = "algorithm.rollout_correction"
        defaults = type(correction).model_fields
        if correction.weight == "none" and correction.reject == "none":
            found.append(Problem(field, "corrects nothing (weight and reject none): set a preset, weight or reject"))
        if correction.weight == "none" and correction.weight_cap != defaults["weight_cap"].default:
            found.append(Problem(f"{field}.weight_cap", "read only with a weight (token or sequence): remove it"))
        band = (correction.reject_low, correction.reject_high)
        if correction.reject == "none" and band != (defaults["reject_low"].default, defaults["reject_high"].default):
            found.append(
                Problem(
                    f"{field}.reject", "none, but reject_low or reject_high is set: set a reject or remove the band"
                )
            )
        if (
            correction.reject != "none"
            and correction.reject_high is not None
            and correction.reject_low >= correction.reject_high
        ):
            found.append(
                Problem(
                    f"{field}.reject_low",
                    f"{correction.reject_low:g} is not below reject_high {correction.reject_high:g}"
                    ": the band keeps nothing",
                )
            )
    budget = cfg.monitoring.mismatch
    if budget is not None and budget.action == "correct" and correction is None:
        found.append(
            Problem(
                "monitoring.mismatch.action",
                "correct switches algorithm.rollout_correction on once an iteration passes the budget, but none "
                "is set: set algorithm.rollout_correction (e.g. preset: trl), or use action warn or stop",
            )
        )
    measured = [
        name
        for name, value in (
            ("algorithm.rollout_correction", correction),
            ("monitoring.mismatch", cfg.monitoring.mismatch),
        )
        if value is not None
    ]
    rollout = cfg.rollout
    others = {
        "algorithm.name gspo (its ratio and clip are per sequence; the weight multiplies a per-token advantage)": (
            cfg.algorithm.name == "gspo" and correction is not None
        ),
        "algorithm.name dpo (it samples no tokens)": cfg.algorithm.name == "dpo",
        "rollout.partial_rollout (its responses span two policy versions: rollout.importance_correction corrects "
        "the older version's tokens; monitoring.mismatch alone measures the gap on the newer's)": (
            rollout.partial_rollout != "off" and correction is not None
        ),
        "rollout.importance_correction (one correction: decoupled is weight token against partial rollout's "
        "sampling logprobs)": rollout.importance_correction is not None and correction is not None,
        "algorithm.recompute_old_logprobs never (the gap is measured in the old-logprob pass)": (
            cfg.algorithm.recompute_old_logprobs == "never"
        ),
    }
    found.extend(
        Problem(field, f"not with {other}") for field in measured for other, present in others.items() if present
    )
    return found
