"""The operator's rules table (rules.py): its order, and how a module picks the rule that decides."""

from __future__ import annotations

import pytest

from rldock.operator.rules import RULES, Rule, first_rule


def test_the_rules_apply_in_this_order():
    """The one place the precedence is pinned: the round, the status and the actions all read it."""
    assert RULES == (
        Rule.MANAGED_ELSEWHERE,
        Rule.FINISHED,
        Rule.REFUSED,
        Rule.SUSPENDED,
        Rule.SUSPENDED_BY_OTHER,
        Rule.BLOCKED,
        Rule.ATTEMPT_REFUSED,
        Rule.ATTEMPT_SUCCEEDED,
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
