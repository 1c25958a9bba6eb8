"""monitoring.mismatch: which iteration passes the budget, what `warn`, `correct` and `stop` do, and the
progress line that carries the figure to the operator."""

from __future__ import annotations

import json
import logging

import pytest

from rldock.config.monitoring import MonitoringSpec
from rldock.contract.failure import FailureReason
from rldock.contract.progress import MISMATCH_KL, PREFIX
from rldock.runtime.driver import mismatch_budget
from rldock.runtime.driver.mismatch_budget import MismatchBudget, MismatchOverBudget, over_budget
from rldock.runtime.driver.records import progress_line

RECORD = {"iteration": 7, "reward_mean": 0.5, "kl": 0.01, "loss": 0.2, "response_length_mean": 4.0}
RECORD |= {"tokens_per_s_per_device": 100.0, "mismatch/kl": 0.0234567}


def _budget(max_kl: float, action: str = "warn") -> MonitoringSpec:
    return MonitoringSpec.model_validate({"mismatch": {"max_kl": max_kl, "action": action}})


def test_only_an_iteration_over_a_set_budget_passes_it():
    assert over_budget(MonitoringSpec(), RECORD) is None  # no budget
    assert over_budget(_budget(0.03), RECORD) is None  # under
    assert over_budget(_budget(0.0234567), RECORD) is None  # at it: not over
    assert over_budget(_budget(0.01), {k: v for k, v in RECORD.items() if k != "mismatch/kl"}) is None  # not measured
    over = over_budget(_budget(0.01), RECORD)
    assert over == MismatchOverBudget(iteration=7, kl=0.0234567, max_kl=0.01, stops=False)


def test_warn_logs_the_iteration_the_figure_and_the_fix(caplog):
    over = over_budget(_budget(0.01), RECORD)
    assert over is not None
    with caplog.at_level(logging.WARNING):
        over.act()  # returns: the run goes on
    (message,) = caplog.messages
    assert message.startswith("iteration 7: mismatch/kl 0.02346 is over monitoring.mismatch.max_kl 0.01")
    assert "algorithm.rollout_correction" in message and "rollout.dtype" in message


def test_stop_raises_with_the_failure_line_s_reason_and_field():
    over = over_budget(_budget(0.01, "stop"), RECORD)
    assert over is not None and over.stops
    with pytest.raises(MismatchOverBudget) as raised:
        over.act()
    failure = raised.value.failure()
    assert failure.reason is FailureReason.ROLLOUT_MISMATCH
    assert [(p.field, p.message) for p in failure.problems] == [("monitoring.mismatch.max_kl", str(over))]


def test_the_progress_line_carries_the_mismatch_to_four_figures_where_it_is_measured(tmp_path):
    from rldock.runtime import checkpoint as ckpt

    line = progress_line(RECORD, 40, ckpt.commit(tmp_path, ckpt.staging_dir(tmp_path, 5), 5, {}, keep_last=1), None)
    assert line.startswith(PREFIX)
    figures = json.loads(line.removeprefix(PREFIX))
    assert figures[MISMATCH_KL] == 0.02346 and (figures["iteration"], figures["checkpoint"]) == (7, 5)
    plain = {k: v for k, v in RECORD.items() if k != "mismatch/kl"}
    assert MISMATCH_KL not in json.loads(progress_line(plain, 40, None, None).removeprefix(PREFIX))


class _Actor:
    """An actor rank's handle as the budget calls it (`apply_rollout_correction.remote()`), counting the
    calls; `ray.get` is given what the calls return (test_correct_... patches it)."""

    def __init__(self) -> None:
        self.switched = 0
        self.apply_rollout_correction = self

    def remote(self) -> None:
        self.switched += 1


def test_correct_switches_the_correction_on_after_the_first_passing_and_on_every_later_attempt(monkeypatch):
    monkeypatch.setattr(mismatch_budget.ray, "get", lambda refs: refs)
    spec, actors = _budget(0.01, "correct"), [_Actor(), _Actor()]
    budget = MismatchBudget(spec, [], actors)
    under = {**RECORD, "iteration": 1, "mismatch/kl": 0.005}
    assert budget.judge(under) is None and under["mismatch/correcting"] == 0.0
    over = budget.judge(dict(RECORD))
    assert over is not None and not over.stops
    budget.act(over)  # logs, returns, and switches every rank on once
    assert [actor.switched for actor in actors] == [1, 1]
    later = {**RECORD, "iteration": 8}
    assert budget.judge(later) is not None and later["mismatch/correcting"] == 1.0
    budget.act(budget.judge(later) or over)  # a later passing switches nothing again
    assert [actor.switched for actor in actors] == [1, 1]
    # A new attempt (a resume, a restart) switches its fresh ranks on from the records' passing...
    fresh = [_Actor()]
    MismatchBudget(spec, [under, RECORD], fresh)
    assert fresh[0].switched == 1
    # ...but not before one passed, nor under another action
    untouched = [_Actor()]
    MismatchBudget(spec, [{"iteration": 0}, under], untouched)
    MismatchBudget(_budget(0.01, "warn"), [RECORD], untouched)
    assert untouched[0].switched == 0
    plain = dict(RECORD)
    MismatchBudget(_budget(0.01, "warn"), [], []).judge(plain)
    assert "mismatch/correcting" not in plain  # only `correct` says whether it corrected
