"""The operator's rules table (rules.py): its order, how the first rule that holds decides, and
classify, which tests each rule on a round's facts."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from rljob_testing import spec_dict

from rldock.config import Problem
from rldock.operator.api import RLJobSpec, RLJobStatus
from rldock.operator.constants import Phase
from rldock.operator.facts import RoundFacts
from rldock.operator.rules import RULES, Rule, classify, first_rule


def test_the_rules_apply_in_this_order():
    """The one place the precedence is pinned: classify tests the rules in this order."""
    assert RULES == (
        Rule.MANAGED_ELSEWHERE,
        Rule.FINISHED,
        Rule.REFUSED,
        Rule.SUSPENDED,
        Rule.SUSPENDED_BY_OTHER,
        Rule.BLOCKED,
        Rule.PREEMPTED,
        Rule.ATTEMPT_REFUSED,
        Rule.ATTEMPT_SUCCEEDED,
        Rule.WORKER_DRAINED,
        Rule.ATTEMPT_FAILED,
        Rule.ATTEMPT_RUNNING,
        Rule.STARTING,
    )


def test_the_first_rule_that_holds_decides_whatever_order_the_tests_are_given_in():
    tests = {Rule.ATTEMPT_FAILED: lambda: True, Rule.SUSPENDED: lambda: True, Rule.FINISHED: lambda: False}
    assert first_rule(tests) is Rule.SUSPENDED


def test_rules_below_the_deciding_one_are_not_tested():
    """A lower rule's test may read what only exists when the rules above do not hold."""

    def spec_suspend() -> bool:
        raise AssertionError("tested although REFUSED decided")

    assert first_rule({Rule.REFUSED: lambda: True, Rule.SUSPENDED: spec_suspend}) is Rule.REFUSED


def test_starting_holds_when_no_tested_rule_does():
    assert first_rule({}) is Rule.STARTING
    assert first_rule({Rule.BLOCKED: lambda: False}) is Rule.STARTING
    with pytest.raises(ValueError, match="STARTING holds when no other rule does"):
        first_rule({Rule.STARTING: lambda: True})


def _facts(**facts) -> RoundFacts:
    return RoundFacts(name="grpo", now=datetime(2026, 3, 1, tzinfo=timezone.utc), **facts)


def test_classify_decides_the_rules_of_the_spec_before_the_round_looks_at_the_cluster():
    spec = RLJobSpec.model_validate(spec_dict())
    assert classify(_facts(managed_elsewhere=True)) is Rule.MANAGED_ELSEWHERE
    assert classify(_facts(spec=spec, previous=RLJobStatus(phase=Phase.SUCCEEDED))) is Rule.FINISHED
    assert classify(_facts(problems=(Problem("spec.checkpoint", "set exactly one"),))) is Rule.REFUSED
    assert classify(_facts(spec=spec)) is None  # none holds: look at the cluster first
    assert classify(_facts(spec=spec, looked=True)) is Rule.STARTING
