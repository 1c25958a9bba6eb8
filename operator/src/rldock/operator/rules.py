"""The operator's rules in the order they apply: one table that the round (reconcile.py), the
status (status.py) and the actions (actions.py) read, so their precedence is written once.

A module tests the rules it has something to do for, from the top, against the facts it has; the
first that holds decides (`first_rule`). A module that does not test a rule skips it: the round
tests only the first three, then hands over to the status and the actions. The last rule,
STARTING, holds whenever no rule above it does.

    rule                when                                  status                       actions
    MANAGED_ELSEWHERE   spec.managedBy names another          none written                 none
                        controller
    FINISHED            the phase is terminal: Succeeded, or  kept as it was               stop a driver still
                        Failed for good (not a Failed only                                 running, delete the
                        the spec caused, which fixing it                                   RayCluster
                        undoes)
    REFUSED             the spec is invalid, or outside the   Failed (InvalidSpec,         delete the RayCluster
                        admin's policy                        PolicyDenied)                (the round's release)
    SUSPENDED           spec.suspend                          Suspended                    stop the driver, free the
                                                                                           cluster (suspend it;
                                                                                           delete it under Kueue)
    SUSPENDED_BY_OTHER  someone else (Kueue, an admin)        Suspended; under Kueue:      none: theirs to undo, no
                        suspended the RayCluster              waiting for admission        restart counted
                                                              (STARTING)
    BLOCKED             a child cannot be had (a name         Pending or Retrying,         none (not reached)
                        conflict, a refused create, a         ClusterReady=False naming
                        refused token)                        the fix
    ATTEMPT_REFUSED     the runtime refused its inputs        Failed, not retried          (FINISHED)
    ATTEMPT_SUCCEEDED   the Ray job succeeded                 Succeeded                    (FINISHED)
    ATTEMPT_FAILED      the Ray job failed or was stopped,    Retrying, or Failed at       stop the driver, count a
                        or a worker was lost while it ran     backoffLimit                 restart
    ATTEMPT_RUNNING     the Ray job is pending or running     Running (pending: as         bring the cluster back,
                                                              STARTING)                    leave the driver be
    STARTING            none of the above: the cluster        Pending, Provisioning, or    create the cluster, replace
                        decides                               Retrying after a restart     it when the spec moved, then
                                                                                           submit the attempt
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum


class Rule(str, Enum):
    """A rule of the table above; the Enum's order is the rules' order."""

    MANAGED_ELSEWHERE = "ManagedElsewhere"
    FINISHED = "Finished"
    REFUSED = "Refused"
    SUSPENDED = "Suspended"
    SUSPENDED_BY_OTHER = "SuspendedByOther"
    BLOCKED = "Blocked"
    ATTEMPT_REFUSED = "AttemptRefused"
    ATTEMPT_SUCCEEDED = "AttemptSucceeded"
    ATTEMPT_FAILED = "AttemptFailed"
    ATTEMPT_RUNNING = "AttemptRunning"
    STARTING = "Starting"


RULES: tuple[Rule, ...] = tuple(Rule)


def first_rule(tests: Mapping[Rule, Callable[[], bool]]) -> Rule:
    """The first rule of RULES whose test holds, STARTING when none does. A rule with no test
    here is skipped; tests after the deciding one are not called (a test may read facts that only
    exist when the rules above it do not hold, e.g. a parsed spec)."""
    if Rule.STARTING in tests:
        raise ValueError("STARTING holds when no other rule does: it takes no test")
    for rule in RULES:
        test = tests.get(rule)
        if test is not None and test():
            return rule
    return Rule.STARTING
